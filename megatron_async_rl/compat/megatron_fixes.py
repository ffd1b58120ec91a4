"""Fixes for megatron-core defects that hit every device, CPU and CUDA alike.

Owned here: patches that are not about running on a CPU (those are `megatron_cpu`'s) but about
megatron-core itself, installed by `platform.setup_process` on every platform before a model is
built. Each is declared in `PATCHES` (`compat.versions.Patch`) with the megatron-core releases
that have its defect, and is installed only on those: four were fixed upstream by 0.19
(`te_general_gemm`, MLA's `HAVE_TE`, the expert-bias group, FSDP2's `finish_grad_sync`; checked
by each patch's probe against 0.16.1 and 0.19.2 in `tests/unit/test_compat_versions.py`). Each
names the defect and where it was seen; each is idempotent.

- (0.16 only) `moe_utils.te_general_gemm` is imported only inside `try: from transformer_engine
  ...`, and the router's `RouterGatingLinearFunction` tests `te_general_gemm is not None`: without
  Transformer Engine the name is unbound and every MoE forward raises NameError. Seen on an H100
  without Transformer Engine (`tests/gpu/test_parity_cuda.py`, qwen3_moe, 2026-11-25); bound to
  None, the router takes its torch.mm path.
- Multi-latent attention on the local (non-Transformer-Engine) spec cannot be built: MLA passes
  `k_channels` / `v_channels` (query-key and value head sizes differ) to its core attention, and
  the local `DotProductAttention` takes neither, and sizes its output by `kv_channels`. Seen
  building a tiny DeepSeek-V3 on CPU (`tests/distributed/test_hf_parity.py`, 2026-11-26).
  `mla_local_spec` swaps in `MLADotProductAttention`, which computes the same attention with the
  value head size for the output (its forward is upstream's: scores need only q and k to agree).
- (0.16 only) Without Transformer Engine, `multi_latent_attention` still finds `HAVE_TE` true
  (megatron-core's `extensions.transformer_engine` imports, with MagicMock placeholders), and its
  `isinstance(..., TELinear)` raises TypeError for every MLA layer. `HAVE_TE` is set false there
  when `TELinear` is not a class. Seen with the previous defect.
- On the local spec with TP > 1, MLA gathers its column-split down projections with
  `gather_from_tensor_model_parallel_region(x)` (and scatters with
  `scatter_to_sequence_parallel_region(x)`) without a group, i.e. from megatron's global
  parallel state, which roles built from explicit process groups never initialise (None.size()).
  `mla_local_spec` builds `MLASelfAttentionWithGroups`, which supplies its own TP group to those
  calls. Seen in the TP=2 MLA parity test (2026-11-26).
- With --pipeline-model-parallel-layout, `get_transformer_layer_offset(config, vp_stage,
  pp_rank)` and `get_num_layers_to_build(config, vp_stage, pp_rank)` drop the `pp_rank` they are
  given and ask the layout for the global parallel state's pipeline rank (uninitialised with
  explicit groups). The fixed versions pass it on; installed into every megatron-core module that
  imported the originals. Seen in the layout parity test (2026-11-26).
- (0.16 only) With --moe-router-enable-expert-bias (DeepSeek-V3's aux-loss-free balancing, set by
  every deepseek_v3 checkpoint), `finalize_model_grads` updates the routers' expert bias with
  `get_updated_expert_bias`, which all-reduces the tokens per expert over the global parallel
  state's tensor-and-data-parallel group: "tensor and data parallel group is not initialized" at
  the first optimizer step of every such model. `finalize_model_grads_in_role` (the trained roles'
  `finalize_model_grads_func`) makes the same update over the role's own `tp_dp_cp` group, then
  lets megatron-core finalize the rest. Seen training a tiny DeepSeek-V3 on CPU (2026-11-26);
  `tests/distributed/test_expert_bias_update.py`.
- (0.16 only) With --use-torch-fsdp2, `finalize_model_grads` calls
  `finish_grad_sync(force_all_reduce=...)` on each model chunk, and
  `TorchFullyShardedDataParallel` inherits `_BaseDataParallel`'s `finish_grad_sync(self)`:
  TypeError at the first optimizer step, on every device (NVIDIA/Megatron-LM issue #4669, fixed
  upstream after 0.16.1 by PR #4953). It gets a `finish_grad_sync` that takes the argument and,
  like the inherited one, does nothing: FSDP2 has reduce-scattered the gradients in its backward
  hooks. Seen training a tiny Llama on CPU (2026-11-26); `tests/distributed/test_torch_fsdp2.py`.
- Also with --use-torch-fsdp2, a checkpoint of the (non-distributed) optimizer pairs each
  optimizer parameter with the model's sharded tensor by `id`: the model side holds each
  DTensor's `_local_tensor` (`make_sharded_tensor_for_checkpoint`), the optimizer side
  `param.to_local()` (`dist_checkpointing.optimizer.get_optim_param_to_id_map`), which torch
  2.13 returns as a fresh view for a Parameter (pytorch/pytorch#166156): no pair is found,
  "ValueError: Param id 0 does not match any model sharded param" at the first save. The
  optimizer side is given the `_local_tensor` itself. Seen with the previous defect.
- And in that checkpoint, `MLP.sharded_state_dict` passes SwiGLU's `linear_fc1` through
  `apply_swiglu_sharded_factory` (transformer/mlp.py:276), which takes a rank's rows for a
  tensor-parallel shard `[gate_r; up_r]` and splits them in two. Under FSDP2 (tensor
  parallelism 1) a rank's rows are a data-parallel shard of the whole `[gate; up]`, already
  placed right by `make_tp_sharded_tensor_for_checkpoint`: the split mislabels them (gate and up
  rows swapped in the file; measured: a DDP role loading it got `linear_fc1` 0.52 off, a round
  trip at the same FSDP2 size hid it). Inside `fsdp2_row_shards()` the factory is skipped.
- With a padding mask, `TopKRouter._apply_expert_bias` computes `routing_map & ~padding_mask`
  with the routing map [tokens, experts] and the mask [tokens]: the shapes do not broadcast, a
  RuntimeError at the first train step of every expert-bias model (DeepSeek-V3) given the mask
  (`roles.megatron_role`: MoE train steps pass the batch's padding). The mask gets its expert
  axis first. Seen training a tiny DeepSeek-V3 on CPU (2026-11-26);
  `tests/distributed/test_expert_bias_update.py`.
- Multi-token prediction (--mtp-num-layers) reads the global parallel state in several places
  and returns the main loss instead of logits: `compat.megatron_mtp`, installed from here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

from megatron_async_rl.compat import megatron_mtp, versions

_MLA_TP_GROUP: contextvars.ContextVar = contextvars.ContextVar("mla_tp_group", default=None)


def install() -> list[str]:
    """Apply every fix whose range holds the installed megatron-core (idempotent); then the MTP
    module's. Returns the names of the fixes applied."""
    return versions.install(PATCHES) + list(megatron_mtp.install() or ())


def _bind_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _te_general_gemm_unbound() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm") and not getattr(moe_utils, "HAVE_TE", False)


def _mla_sees_no_te() -> None:
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def _mla_believes_te() -> bool:
    from megatron.core.transformer import multi_latent_attention as mla

    return bool(mla.HAVE_TE) and not isinstance(mla.TELinear, type)


def _local_attention_lacks_head_sizes() -> bool:
    import inspect

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return "v_channels" not in inspect.signature(DotProductAttention.__init__).parameters


def _mla_gathers_without_group() -> bool:
    import inspect
    import re

    from megatron.core.transformer import multi_latent_attention as mla

    source = inspect.getsource(mla.MLASelfAttention.get_query_key_value_tensors)
    return re.search(r"gather_from_tensor_model_parallel_region\(\w+\)", source) is not None


def _layout_drops_pp_rank() -> bool:
    import inspect

    from megatron.core.transformer import transformer_layer

    source = inspect.getsource(transformer_layer.get_transformer_layer_offset)
    call = source[source.index("pipeline_model_parallel_layout.get_layer_offset("):]
    return "pp_rank" not in call[: call.index(")")]


def _expert_bias_update_on_global_group() -> bool:
    import importlib
    import inspect

    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    update = module._update_router_expert_bias
    return "tp_dp_cp_group" not in inspect.signature(update).parameters


def _fsdp2_grad_sync_lacks_argument() -> bool:
    import inspect

    from megatron.core.distributed import TorchFullyShardedDataParallel as FSDP

    return "force_all_reduce" not in inspect.signature(FSDP.finish_grad_sync).parameters


def _optimizer_ids_from_to_local() -> bool:
    import inspect

    from megatron.core.dist_checkpointing import optimizer as ckpt_optimizer

    source = inspect.getsource(ckpt_optimizer.get_optim_param_to_id_map)
    return "_local_tensor" not in source and ("to_local" in source)


def _swiglu_factory_unconditional() -> bool:
    import inspect

    from megatron.core.transformer import mlp

    source = inspect.getsource(mlp.MLP.sharded_state_dict)
    return "apply_swiglu_sharded_factory(" in source and "fsdp" not in source.lower()


def _expert_bias_mask_unbroadcast() -> bool:
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter

    source = inspect.getsource(TopKRouter._apply_expert_bias)
    return "routing_map & (~padding_mask)" in source and "unsqueeze" not in source


_ALL = ">=0.16.1,<0.20"  # every supported release has the defect
PATCHES = [
    versions.Patch(
        "te_general_gemm_unbound", "megatron-core", ">=0.16.1,<0.17",
        "moe_utils.te_general_gemm unbound without Transformer Engine (NameError in the router)",
        _bind_te_general_gemm, _te_general_gemm_unbound,
    ),
    versions.Patch(
        "mla_have_te_placeholder", "megatron-core", ">=0.16.1,<0.17",
        "multi_latent_attention.HAVE_TE true with MagicMock placeholders when TE is absent",
        _mla_sees_no_te, _mla_believes_te,
    ),
    versions.Patch(
        "mla_local_head_sizes", "megatron-core", _ALL,
        "local DotProductAttention takes no k_channels/v_channels: MLA cannot be built",
        lambda: None, _local_attention_lacks_head_sizes,  # applied by mla_local_spec
    ),
    versions.Patch(
        "mla_gather_global_tp", "megatron-core", _ALL,
        "MLA's q/kv gathers name no group: the global TP group, never initialised here",
        lambda: None, _mla_gathers_without_group,  # applied by mla_local_spec
    ),
    versions.Patch(
        "layout_drops_pp_rank", "megatron-core", _ALL,
        "with a pipeline layout, the layer offset/count ask the global state for the pp rank",
        lambda: _install_layout_rank_fix(), _layout_drops_pp_rank,
    ),
    versions.Patch(
        "expert_bias_global_group", "megatron-core", ">=0.16.1,<0.17",
        "finalize_model_grads updates the expert bias over the global tensor+data group",
        lambda: None, _expert_bias_update_on_global_group,  # in finalize_model_grads_in_role
    ),
    versions.Patch(
        "fsdp2_finish_grad_sync", "megatron-core", ">=0.16.1,<0.17",
        "TorchFullyShardedDataParallel.finish_grad_sync takes no force_all_reduce (TypeError)",
        lambda: _install_fsdp2_grad_sync_fix(), _fsdp2_grad_sync_lacks_argument,
    ),
    versions.Patch(
        "fsdp2_optimizer_param_ids", "megatron-core", _ALL,
        "optimizer checkpoint pairs params by id of param.to_local(), a fresh view each call",
        lambda: _install_dtensor_param_id_fix(), _optimizer_ids_from_to_local,
    ),
    versions.Patch(
        "fsdp2_swiglu_rows", "megatron-core", _ALL,
        "SwiGLU's sharded factory splits an FSDP2 row shard as if it were a TP shard",
        lambda: _install_swiglu_row_shard_fix(), _swiglu_factory_unconditional,
    ),
    versions.Patch(
        "expert_bias_mask_shape", "megatron-core", _ALL,
        "TopKRouter._apply_expert_bias ANDs [tokens, experts] with a [tokens] padding mask",
        lambda: _install_expert_bias_mask_fix(), _expert_bias_mask_unbroadcast,
    ),
]  # fmt: skip
_BY_NAME = {patch.name: patch for patch in PATCHES}


def applies(name: str) -> bool:
    """Whether the installed megatron-core gets fix `name` (for fixes applied where used)."""
    patch = _BY_NAME[name]
    return patch.applies_to(versions.installed_version(patch.package))


def _install_fsdp2_grad_sync_fix() -> None:
    import inspect

    from megatron.core.distributed import TorchFullyShardedDataParallel as FSDP

    if "force_all_reduce" in inspect.signature(FSDP.finish_grad_sync).parameters:
        return

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Nothing to finish: FSDP2 reduce-scatters each unit's gradients in its backward."""

    FSDP.finish_grad_sync = finish_grad_sync


def _install_dtensor_param_id_fix() -> None:
    from megatron.core.dist_checkpointing import optimizer as ckpt_optimizer

    original = ckpt_optimizer.get_optim_param_to_id_map
    if getattr(original, "_dtensor_id_fix", False):
        return

    @functools.wraps(original)
    def param_to_id_map(optim_params_iter):
        return original(getattr(p, "_local_tensor", p) for p in optim_params_iter)

    param_to_id_map._dtensor_id_fix = True
    ckpt_optimizer.get_optim_param_to_id_map = param_to_id_map


_FSDP2_ROW_SHARDS: contextvars.ContextVar = contextvars.ContextVar("fsdp2_rows", default=False)


@contextlib.contextmanager
def fsdp2_row_shards():
    """Build a sharded state dict of a model under FSDP2 (tensor parallelism 1) inside this
    block: its SwiGLU `linear_fc1` rows are left as megatron-core placed them (see the module
    docstring)."""
    token = _FSDP2_ROW_SHARDS.set(True)
    try:
        yield
    finally:
        _FSDP2_ROW_SHARDS.reset(token)


def _install_swiglu_row_shard_fix() -> None:
    from megatron.core.transformer import mlp

    original = mlp.apply_swiglu_sharded_factory
    if getattr(original, "_row_shard_fix", False):
        return

    @functools.wraps(original)
    def swiglu_factory(original_sh_ten, *args, **kwargs):
        if _FSDP2_ROW_SHARDS.get():
            return original_sh_ten
        return original(original_sh_ten, *args, **kwargs)

    swiglu_factory._row_shard_fix = True
    mlp.apply_swiglu_sharded_factory = swiglu_factory


def _install_expert_bias_mask_fix() -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter._apply_expert_bias
    if getattr(original, "_mask_fix", False):
        return

    @functools.wraps(original)
    def apply_expert_bias(self, routing_map, padding_mask=None):
        if padding_mask is not None and padding_mask.dim() == routing_map.dim() - 1:
            padding_mask = padding_mask.unsqueeze(-1)  # [tokens, 1]: masks every expert
        return original(self, routing_map, padding_mask=padding_mask)

    apply_expert_bias._mask_fix = True
    TopKRouter._apply_expert_bias = apply_expert_bias


def _install_layout_rank_fix() -> None:
    import sys

    from megatron.core.transformer import transformer_block, transformer_layer
    from megatron.core.transformer.enums import LayerType

    offset, count = transformer_layer.get_transformer_layer_offset, (
        transformer_block.get_num_layers_to_build
    )
    if getattr(offset, "_layout_rank_fix", False):
        return

    @functools.wraps(offset)
    def layer_offset(config, vp_stage=None, pp_rank=None):
        layout = config.pipeline_model_parallel_layout
        if layout and pp_rank is not None and config.pipeline_model_parallel_size > 1:
            return layout.get_layer_offset(
                layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
            )
        return offset(config, vp_stage, pp_rank)

    @functools.wraps(count)
    def layers_to_build(config, vp_stage=None, pp_rank=None):
        layout = config.pipeline_model_parallel_layout
        if layout is not None and pp_rank is not None:
            return layout.get_num_layers_to_build(
                layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
            )
        return count(config, vp_stage, pp_rank)

    layer_offset._layout_rank_fix = layers_to_build._layout_rank_fix = True
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            if getattr(module, "get_transformer_layer_offset", None) is offset:
                module.get_transformer_layer_offset = layer_offset
            if getattr(module, "get_num_layers_to_build", None) is count:
                module.get_num_layers_to_build = layers_to_build


@functools.cache
def _mla_dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        """Local core attention with query-key heads of `k_channels` and value heads of
        `v_channels` (the context is sized by the latter)."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                heads = self.num_attention_heads_per_partition
                self.hidden_size_per_partition = v_channels * heads
                self.hidden_size_per_attention_head = divide(
                    self.hidden_size_per_partition, heads
                )

    return MLADotProductAttention


def _group_defaults_to_mla_tp(fn):
    """`fn(input_, group=None, ...)` with group defaulting to the calling MLA layer's TP group."""
    if getattr(fn, "_mla_tp_default", False):
        return fn

    @functools.wraps(fn)
    def call(input_, group=None, *args, **kwargs):
        return fn(input_, group if group is not None else _MLA_TP_GROUP.get(), *args, **kwargs)

    call._mla_tp_default = True
    return call


@functools.cache
def _mla_self_attention_with_groups():
    from megatron.core.transformer import multi_latent_attention as mla

    for name in ("gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region"):
        setattr(mla, name, _group_defaults_to_mla_tp(getattr(mla, name)))

    class MLASelfAttentionWithGroups(mla.MLASelfAttention):
        """MLASelfAttention whose q/kv gathers use this layer's TP group."""

        def get_query_key_value_tensors(self, *args, **kwargs):
            token = _MLA_TP_GROUP.set(self.tp_group)
            try:
                return super().get_query_key_value_tensors(*args, **kwargs)
            finally:
                _MLA_TP_GROUP.reset(token)

    return MLASelfAttentionWithGroups


def mla_local_spec(block_spec):
    """`block_spec` (a TransformerBlockSubmodules of the local spec) with every MLA layer built as
    `MLASelfAttentionWithGroups` around `MLADotProductAttention`. Returns the same object, edited
    (megatron-core builds fresh specs per call; editing twice is a no-op)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    core = _mla_dot_product_attention() if applies("mla_local_head_sizes") else None
    attention_cls = (
        _mla_self_attention_with_groups() if applies("mla_gather_global_tp") else None
    )
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if attention.module is MLASelfAttention:
            attention.module = attention_cls or attention.module
            if core is not None and attention.submodules.core_attention is DotProductAttention:
                attention.submodules.core_attention = core
    return block_spec


def finalize_model_grads_in_role(model, num_tokens=None, pg_collection=None,
                                 force_all_reduce=False):  # fmt: skip
    """megatron-core's `finalize_model_grads`, with the expert-bias update over the role's
    `pg_collection.tp_dp_cp` (see the module docstring). The update is megatron-core's formula
    (`moe_utils.get_updated_expert_bias`: each bias moves by the update rate towards the mean
    load, by the sign of its expert's deficit), written out here because that function's
    all-reduce names the global group; it runs before the gradient sync instead of after it,
    which nothing in between reads."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    config = get_model_config(model[0])
    if not config.moe_router_enable_expert_bias or not applies("expert_bias_global_group"):
        return finalize_model_grads(model, num_tokens, pg_collection, force_all_reduce)
    routers = [
        module for chunk in model for module in get_attr_wrapped_model(chunk, "modules")()
        if getattr(module, "expert_bias", None) is not None
    ]  # fmt: skip
    if routers:
        with torch.no_grad():
            tokens = torch.stack([r.local_tokens_per_expert for r in routers])
            dist.all_reduce(tokens, group=pg_collection.tp_dp_cp)
            deficit = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1] - tokens
            for router, row in zip(routers, deficit):
                router.expert_bias.add_(torch.sign(row) * config.moe_router_bias_update_rate)
                router.local_tokens_per_expert.zero_()
    config.moe_router_enable_expert_bias = False  # megatron-core's own update: done above
    try:
        return finalize_model_grads(model, num_tokens, pg_collection, force_all_reduce)
    finally:
        config.moe_router_enable_expert_bias = True
