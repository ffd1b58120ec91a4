"""Multi-token prediction (--mtp-num-layers) on explicit process groups, returning logits.

Owned here: what megatron-core needs to build and run a GPTModel's MTP block inside a role
built from explicit process groups, whose global `parallel_state` is never initialised, and the
one change of behaviour an RL actor needs. Installed by `megatron_fixes.install` (every
platform, before a model is built); used by `models.builder` (building) and
`roles.megatron_role` (the actor's train step). Each defect's fix is a `compat.versions.Patch`
in `PATCHES`, declared for the megatron-core releases that have the defect and installed only
there (each probe is checked against 0.16.1 and 0.19.2 by `tests/unit/test_compat_versions.py`);
each is idempotent.

Defects, each an AssertionError or None-group error at build, first forward or first save:
- (0.16) `GPTModel.__init__` builds `MultiTokenPredictionBlock(config, spec, vp_stage)` without
  its `pg_collection`, so the block asks the global state for one. Inside `process_groups(pgc)`
  (the builder's) a block built without groups takes `pgc`. The block also has no `tp_group`,
  so `MegatronModule.sharded_state_dict` (every checkpoint save and load) asks the global
  state for it: the block gets the collection's. (`mtp_block_no_groups`; 0.19 passes them.)
- (0.16) `MultiTokenPredictionLayer` builds its `eh_proj` (a ColumnParallelLinear) without a TP
  group and its transformer layer without the collection, and gathers `eh_proj`'s output with
  `gather_from_tensor_model_parallel_region(x)` (no group). `block_spec_with_groups` builds
  `LayerWithGroups` there, which hands the collection and TP group to both and supplies its
  own TP group to that gather (and to the sequence-parallel scatter after it).
  (`mtp_layer_no_groups`; 0.19 passes its `pg_collection` on, and `block_spec_with_groups`
  leaves megatron-core's layer in place.)
- (0.16) `MultiTokenPredictionLayer` numbers its transformer layer from
  `get_transformer_layer_offset(config, vp_stage)`, without a pipeline rank: given the role's.
  (`mtp_layer_offset_no_rank`; 0.19 numbers the MTP layers on their own.)
- (0.16, 0.19) `get_mtp_num_layers_to_build` asks the global state whether this is the last
  pipeline stage (the `pp_rank` it is given is not used there): answered from the role's
  pipeline group (the builder's `pp_rank`, or the collection of `process_groups`): the MTP
  layers are built on its last stage, in its last virtual stage, or where a pipeline layout
  puts them at the role's rank. (`mtp_build_on_global_stage`)
- (0.16, 0.19) With a pipeline layout, `get_mtp_layer_offset(config, vp_stage)` (asked by the
  spec, the layers, the block's forward and its sharded state dict) asks the layout for the
  global pipeline rank: given the role's while building, else the rank the layout puts the
  MTP layers on (megatron-core's layout validation keeps them all in one virtual stage of one
  rank, and only there is it asked). (`mtp_offset_global_rank`)
- (0.19) `GPTModel.__init__` asks `mtp_on_this_rank(...)` whether it holds the MTP block (0.16
  took the spec's presence), which reads the global pipeline rank: answered from the role's
  pipeline group, as upstream answers it otherwise. (`mtp_rank_from_global_stage`)
- (0.16, 0.19) With tied embeddings, the MTP stage of a pipeline (size > 1) allocates an
  output-layer weight it never uses, whose sharded state dict megatron-core asserts absent: it
  is checkpointed as a replica of the first stage's embedding. (`mtp_tied_output_weight`)
`config.megatron.rules` offers MTP with virtual stages or a layout (its MTP layers in the last
stage) from megatron-core 0.19 on.
With pipeline size > 1 the last stage also holds a copy of the word embedding (the MTP layers
embed the shifted tokens); megatron-core ties it to the first stage's through the collection's
`embd` group (`setup_embeddings_and_output_layer`, and `finalize_model_grads` all-reduces the
two copies' gradients), as for a tied output layer: no global state read there.

Behaviour, on every release (installed unconditionally). megatron-core's `GPTModel._postprocess`
computes the MTP loss from `labels` (0.16 crashes without them; 0.19 derives them from the input
tokens, over every position), logs it through the global data-parallel group, and returns the
main head's cross-entropy instead of its logits. The RL loss needs the logits (temperature,
entropy, clipping), so an MTP model's `_postprocess` is wrapped:
- inside `loss_hook(hook)` (the actor's train step) the MTP layers run on the decoder's output,
  each layer k's logits come from the shared output layer (with the main head's output scaling
  where megatron-core has one, `_scale_logits`), `hook(k, logits_sbv)` gives (sum of the
  cross-entropy over the tokens it counts, their number), and the loss is attached to the main
  hidden states with megatron-core's `MTPLossAutoScaler`, scaled by mtp_loss_scaling_factor /
  mtp_num_layers, as a mean over the counted tokens (their sum with --calculate-per-token-loss),
  as megatron-core does; the schedule sets the scaler's backward scale per micro-batch, as for
  Megatron-LM;
- outside it (forward-only passes, the logp of the train role) the MTP layers do not run;
- either way megatron-core's own `_postprocess` then computes the main head's logits, with the
  config's `mtp_num_layers` unset for that call (so neither its MTP loss nor its logging runs),
  and the logits are those of the same model without MTP layers.
Calls with `labels` (not made in this package) go to megatron-core unchanged.

Shapes: s, b, h, v megatron-core's [sequence, batch, hidden, vocab shard].
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import re

from megatron_async_rl.compat import versions

_GROUPS: contextvars.ContextVar = contextvars.ContextVar("mtp_pg_collection", default=None)
_TP_GROUP: contextvars.ContextVar = contextvars.ContextVar("mtp_tp_group", default=None)
_LOSS_HOOK: contextvars.ContextVar = contextvars.ContextVar("mtp_loss_hook", default=None)


@contextlib.contextmanager
def process_groups(pg_collection):
    """Build GPTModels inside this block: their MTP blocks get `pg_collection`."""
    token = _GROUPS.set(pg_collection)
    try:
        yield
    finally:
        _GROUPS.reset(token)


@contextlib.contextmanager
def loss_hook(hook):
    """Forward an MTP model inside this block to train its MTP layers: `hook(k, logits_sbv)`
    -> (cross-entropy sum, token count) of MTP layer k (0-based), both scalar tensors, the sum
    differentiable."""
    token = _LOSS_HOOK.set(hook)
    try:
        yield
    finally:
        _LOSS_HOOK.reset(token)


def install() -> list[str]:
    """Apply the defect fixes in range for the installed megatron-core, then the logits
    behaviour (idempotent). Returns the names of the fixes applied."""
    from megatron.core.models.gpt import gpt_model

    applied = versions.install(PATCHES)
    _install_postprocess(gpt_model.GPTModel)
    return applied


def _mtp_module():
    from megatron.core.transformer import multi_token_prediction

    return multi_token_prediction


# Probes: each reads the unpatched upstream (`inspect` follows a patch's __wrapped__).


def _call_args(function, callee: str) -> str | None:
    """The argument text of the first call of `callee` in `function`'s source; None if none."""
    source = inspect.getsource(function)
    match = re.search(rf"(?<![\w.]){re.escape(callee)}\(", source)
    if match is None:
        return None
    depth, end = 1, match.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        end += 1
    return source[match.end() : end - 1]


def _block_built_without_groups() -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    args = _call_args(GPTModel.__init__, "MultiTokenPredictionBlock")
    return args is not None and "pg_collection" not in args


def _layer_built_without_groups() -> bool:
    layer = _mtp_module().MultiTokenPredictionLayer
    gather = _call_args(layer._concat_embeddings, "gather_from_tensor_model_parallel_region")
    return "tp_group" not in inspect.getsource(layer.__init__) or (
        gather is not None and "group" not in gather
    )


def _layer_offset_without_rank() -> bool:
    args = _call_args(_mtp_module().MultiTokenPredictionLayer.__init__,
                      "get_transformer_layer_offset")  # fmt: skip
    return args is not None and "pp_rank" not in args


def _layers_to_build_ask_global_stage() -> bool:
    count = _mtp_module().get_mtp_num_layers_to_build
    return _call_args(count, "parallel_state.is_pipeline_last_stage") is not None


def _mtp_offset_asks_global_rank() -> bool:
    args = _call_args(_mtp_module().get_mtp_layer_offset,
                      "config.pipeline_model_parallel_layout.get_layer_offset")  # fmt: skip
    return args is not None and "pp_rank" not in args


def _block_placed_by_global_rank() -> bool:
    from megatron.core.models.gpt.gpt_model import GPTModel

    on_this_rank = getattr(_mtp_module(), "mtp_on_this_rank", None)
    return (
        _call_args(GPTModel.__init__, "mtp_on_this_rank") is not None
        and _call_args(on_this_rank, "parallel_state.get_pipeline_model_parallel_rank") is not None
    )


def _tied_mtp_stage_keeps_output_weight() -> bool:
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt.gpt_model import GPTModel

    skip = re.search(r"skip_weight_param_allocation=([^,]+),", inspect.getsource(GPTModel.__init__))
    tie = inspect.getsource(LanguageModule.tie_embeddings_and_output_weights_state_dict)
    return skip is not None and "mtp" not in skip[1] and "mtp_process" in tie


# Fixes.


def _give_block_groups() -> None:
    mtp = _mtp_module()
    block_init = mtp.MultiTokenPredictionBlock.__init__
    if getattr(block_init, "_mtp_groups", False):
        return

    @functools.wraps(block_init)
    def init_block(self, config, spec, vp_stage=None, pg_collection=None):
        if pg_collection is None:
            pg_collection = _GROUPS.get()
        block_init(self, config, spec, vp_stage=vp_stage, pg_collection=pg_collection)
        if pg_collection is not None:
            self.tp_group = pg_collection.tp  # its sharded_state_dict's, not the global one

    init_block._mtp_groups = True
    mtp.MultiTokenPredictionBlock.__init__ = init_block


def _default_gathers_to_layer_tp() -> None:
    mtp = _mtp_module()
    for name in ("gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region"):
        fn = getattr(mtp, name)
        if not getattr(fn, "_layer_tp", False):
            setattr(mtp, name, _group_defaults_to_layer_tp(fn))


def _number_layers_from_role_rank() -> None:
    mtp = _mtp_module()
    offset = mtp.get_transformer_layer_offset
    if getattr(offset, "_mtp_groups", False):
        return

    @functools.wraps(offset)
    def layer_offset(config, vp_stage=None, pp_rank=None):
        stage = _pipeline_stage(config, pp_rank)
        if pp_rank is None and stage is not None:
            pp_rank = stage[0]  # the role's rank, not the global state's
        return offset(config, vp_stage, pp_rank)

    layer_offset._mtp_groups = True
    mtp.get_transformer_layer_offset = layer_offset


def _build_on_role_last_stage() -> None:
    from megatron.core.models.gpt import gpt_layer_specs

    mtp = _mtp_module()
    count = mtp.get_mtp_num_layers_to_build
    if getattr(count, "_mtp_groups", False):
        return

    @functools.wraps(count)
    def layers_to_build(config, vp_stage=None, pp_rank=None):
        stage = _pipeline_stage(config, pp_rank)
        if stage is None:
            return count(config, vp_stage=vp_stage, pp_rank=pp_rank)
        rank, size = stage
        layout = config.pipeline_model_parallel_layout
        if layout is not None:  # where the layout puts them, at the role's rank
            from megatron.core.transformer.enums import LayerType

            num = layout.get_num_layers_to_build(LayerType.mtp, vp_stage=vp_stage, pp_rank=rank)
            assert num in (0, config.mtp_num_layers), (num, config.mtp_num_layers)
            return num
        vp_size = config.virtual_pipeline_model_parallel_size
        last = rank == size - 1 and (not vp_size or vp_stage == vp_size - 1)
        return (config.mtp_num_layers or 0) if last else 0  # the last (virtual) stage's

    layers_to_build._mtp_groups = True
    for module in (mtp, gpt_layer_specs):
        if getattr(module, "get_mtp_num_layers_to_build", None) is count:
            module.get_mtp_num_layers_to_build = layers_to_build


def _offset_mtp_layers_at_their_rank() -> None:
    import sys

    from megatron.core.transformer.enums import LayerType

    mtp = _mtp_module()
    offset = mtp.get_mtp_layer_offset
    if getattr(offset, "_mtp_groups", False):
        return

    @functools.wraps(offset)
    def mtp_layer_offset(config, vp_stage=None):
        layout = config.pipeline_model_parallel_layout
        if layout is None or config.pipeline_model_parallel_size == 1:
            return offset(config, vp_stage)
        stage = _pipeline_stage(config, None)
        if stage is None:  # a forward or a save: asked only where the MTP layers are, on the
            # one rank megatron-core's layout validation allows them (its last virtual stage)
            holds = [LayerType.mtp in stages[-1] for stages in layout.layout]
            stage = (holds.index(True) if any(holds) else 0, len(holds))
        return layout.get_layer_offset(LayerType.mtp, vp_stage=vp_stage, pp_rank=stage[0])

    mtp_layer_offset._mtp_groups = True
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            if getattr(module, "get_mtp_layer_offset", None) is offset:
                module.get_mtp_layer_offset = mtp_layer_offset


def _place_block_by_role_rank() -> None:
    import torch.distributed as dist
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer.enums import LayerType

    mtp = _mtp_module()
    original = mtp.mtp_on_this_rank
    if getattr(original, "_mtp_groups", False):
        return

    @functools.wraps(original)
    def on_this_rank(layout=None, mtp_num_layers=None, ignore_virtual=True, vp_stage=None):
        pgc = _GROUPS.get()
        if pgc is None:
            return original(layout, mtp_num_layers, ignore_virtual, vp_stage)
        pp_rank = dist.get_rank(pgc.pp)
        if layout is not None:  # upstream's reading of the layout, at the role's rank
            stages = layout.layout[pp_rank]
            if not ignore_virtual and vp_stage is not None:
                stages = stages[vp_stage : vp_stage + 1]
            return any(LayerType.mtp in stage for stage in stages)
        # Without a layout, the last stage (its last virtual stage: the only chunk there
        # `get_mtp_num_layers_to_build` gives a spec; megatron-core's block asserts it).
        return mtp_num_layers is not None and pp_rank == pgc.pp.size() - 1

    on_this_rank._mtp_groups = True
    for module in (mtp, gpt_model):
        if getattr(module, "mtp_on_this_rank", None) is original:
            module.mtp_on_this_rank = on_this_rank


def _install_tied_state_dict() -> None:
    """With tied embeddings, the MTP stage (pipeline size > 1) still allocates the output
    layer's weight (`skip_weight_param_allocation` is `pre_process` and tied) but computes its
    logits with its copy of the embedding, and its sharded state dict asserts that weight absent
    (the optimizer's then misses it). The unused weight is checkpointed as megatron-core does
    for a tied last stage without MTP: a replica of the first stage's embedding, never saved,
    loaded equal to it (as HF loading fills it)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.utils import get_pg_rank, make_tp_sharded_tensor_for_checkpoint

    original = GPTModel.tie_embeddings_and_output_weights_state_dict
    if getattr(original, "_mtp_groups", False):
        return

    @functools.wraps(original)
    def tie(self, sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key,
            metadata=None):  # fmt: skip
        if not (getattr(self, "mtp_process", False) and self.post_process
                and not self.pre_process):  # fmt: skip
            return original(self, sharded_state_dict, output_layer_weight_key,
                            first_stage_word_emb_key, metadata or {})  # fmt: skip
        dp_cp_group = metadata["dp_cp_group"]
        sharded_state_dict[output_layer_weight_key] = make_tp_sharded_tensor_for_checkpoint(
            tensor=self.output_layer.weight,
            key=first_stage_word_emb_key,
            replica_id=(2, 0, get_pg_rank(dp_cp_group)),  # (1, ...) is the MTP stage's copy
            allow_shape_mismatch=True,
            tp_group=self.tp_group,
            dp_cp_group=dp_cp_group,
        )

    tie._mtp_groups = True
    GPTModel.tie_embeddings_and_output_weights_state_dict = tie


_MEGATRON = "megatron-core"
_LAYER_GROUPS = versions.Patch(
    "mtp_layer_no_groups", _MEGATRON, ">=0.16.1,<0.17",
    "MultiTokenPredictionLayer builds eh_proj and its layer, and gathers, without its groups",
    _default_gathers_to_layer_tp, _layer_built_without_groups,  # and `block_spec_with_groups`
)  # fmt: skip
PATCHES = [
    versions.Patch(
        "mtp_block_no_groups", _MEGATRON, ">=0.16.1,<0.17",
        "GPTModel builds its MultiTokenPredictionBlock without pg_collection (global groups)",
        _give_block_groups, _block_built_without_groups,
    ),
    _LAYER_GROUPS,
    versions.Patch(
        "mtp_layer_offset_no_rank", _MEGATRON, ">=0.16.1,<0.17",
        "MultiTokenPredictionLayer asks get_transformer_layer_offset without the pp rank",
        _number_layers_from_role_rank, _layer_offset_without_rank,
    ),
    versions.Patch(
        "mtp_build_on_global_stage", _MEGATRON, ">=0.16.1,<0.20",
        "get_mtp_num_layers_to_build asks the global state whether this is the last stage",
        _build_on_role_last_stage, _layers_to_build_ask_global_stage,
    ),
    versions.Patch(
        "mtp_offset_global_rank", _MEGATRON, ">=0.16.1,<0.20",
        "with a pipeline layout, get_mtp_layer_offset asks the layout for the global pp rank",
        _offset_mtp_layers_at_their_rank, _mtp_offset_asks_global_rank,
    ),
    versions.Patch(
        "mtp_rank_from_global_stage", _MEGATRON, ">=0.19,<0.20",
        "GPTModel places its MTP block by mtp_on_this_rank, which reads the global pp rank",
        _place_block_by_role_rank, _block_placed_by_global_rank,
    ),
    versions.Patch(
        "mtp_tied_output_weight", _MEGATRON, ">=0.16.1,<0.20",
        "a tied MTP stage allocates an output weight its sharded state dict asserts absent",
        _install_tied_state_dict, _tied_mtp_stage_keeps_output_weight,
    ),
]  # fmt: skip


def _pipeline_stage(config, pp_rank: int | None) -> tuple[int, int] | None:
    """(pipeline rank, pipeline size) of the model being built, from `pp_rank` or the role's
    collection (`process_groups`); None outside a role's build with more than one stage
    (megatron-core's own answer is kept)."""
    size = config.pipeline_model_parallel_size
    if size == 1:
        return 0, 1  # one stage: it is the first and the last whatever the global state says
    pgc = _GROUPS.get()
    if pp_rank is None and pgc is None:
        return None
    import torch.distributed as dist

    if pgc is not None:
        assert pgc.pp.size() == size, (pgc.pp.size(), size)
    return (dist.get_rank(pgc.pp) if pp_rank is None else pp_rank), size


def _group_defaults_to_layer_tp(fn):
    """`fn(input_, group=None, ...)` with group defaulting to the calling MTP layer's TP group."""

    @functools.wraps(fn)
    def call(input_, group=None, *args, **kwargs):
        return fn(input_, group if group is not None else _TP_GROUP.get(), *args, **kwargs)

    call._layer_tp = True
    return call


@functools.cache
def _layer_with_groups():
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    class LayerWithGroups(MultiTokenPredictionLayer):
        """An MTP layer whose projection, transformer layer and gathers use its role's
        groups (`pg_collection`, which the block passes)."""

        def __init__(self, config, submodules, layer_number=1, vp_stage=None,
                     pg_collection=None):  # fmt: skip
            assert pg_collection is not None, "built inside megatron_mtp.process_groups"
            layer = submodules.transformer_layer
            submodules = dataclasses.replace(
                submodules,
                eh_proj=ModuleSpec(
                    module=submodules.eh_proj, params={"tp_group": pg_collection.tp}
                ),
                transformer_layer=ModuleSpec(
                    module=layer.module, submodules=layer.submodules,
                    params={**layer.params, "pg_collection": pg_collection},
                ),
            )  # fmt: skip
            super().__init__(config, submodules, layer_number, vp_stage, pg_collection)
            self.tp_group = pg_collection.tp

        def _concat_embeddings(self, hidden_states, decoder_input):
            token = _TP_GROUP.set(self.tp_group)
            try:
                return super()._concat_embeddings(hidden_states, decoder_input)
            finally:
                _TP_GROUP.reset(token)

    return LayerWithGroups


def block_spec_with_groups(block_spec):
    """`block_spec` (megatron-core's MTP block spec, or None) with each layer built as
    `LayerWithGroups` where megatron-core's layer does not take its groups (`_LAYER_GROUPS`'s
    releases); elsewhere unchanged. Returns the same object, edited."""
    if block_spec is None:
        return None
    if not _LAYER_GROUPS.applies_to(versions.installed_version(_LAYER_GROUPS.package)):
        return block_spec
    layer_cls = _layer_with_groups()
    for layer_spec in block_spec.layer_specs:
        layer_spec.module = layer_cls
    return block_spec


def _install_postprocess(gpt_model_cls) -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    original = gpt_model_cls._postprocess
    if getattr(original, "_mtp_logits", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def postprocess(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        call.pop("self")
        num_layers = self.config.mtp_num_layers
        if not num_layers or call.get("labels") is not None:
            return original(self, **call)
        hook = _LOSS_HOOK.get()
        if hook is not None and call.get("mtp_in_postprocess") and self.post_process:
            call["hidden_states"] = _attach_mtp_loss(self, call, hook, MTPLossAutoScaler)
        call["mtp_in_postprocess"] = False
        self.config.mtp_num_layers = None  # megatron-core's logits path, MTP done above
        try:
            return original(self, **call)
        finally:
            self.config.mtp_num_layers = num_layers

    postprocess._mtp_logits = True
    gpt_model_cls._postprocess = postprocess


@functools.cache
def _takes(cls, name: str) -> bool:
    """Whether `cls.forward` has a parameter `name`."""
    return name in inspect.signature(cls.forward).parameters


def _attach_mtp_loss(model, call: dict, hook, auto_scaler):
    """The main hidden states [s, b, h], carrying each MTP layer's scaled loss for backward."""
    config = model.config
    extra = {}
    if _takes(type(model.mtp), "padding_mask"):  # 0.19: the MTP layers' MoE routing skips pads
        extra["padding_mask"] = call.get("padding_mask")
    stacked_sbh = model.mtp(
        input_ids=call["input_ids"],
        position_ids=call["position_ids"],
        hidden_states=call["hidden_states"],
        attention_mask=call.get("attention_mask"),
        inference_params=call.get("inference_params"),
        rotary_pos_emb=call.get("rotary_pos_emb"),
        rotary_pos_cos=call.get("rotary_pos_cos"),
        rotary_pos_sin=call.get("rotary_pos_sin"),
        packed_seq_params=call.get("packed_seq_params"),
        sequence_len_offset=call.get("sequence_len_offset"),
        embedding=model.embedding,
        **extra,
        **(call.get("extra_block_kwargs") or {}),
    )
    main_sbh, *mtp_sbh = stacked_sbh.chunk(1 + config.mtp_num_layers, dim=0)
    weight = None
    if model.share_embeddings_and_output_weights:
        weight = model.shared_embedding_or_output_weight()
    scale_logits = getattr(model, "_scale_logits", None)  # 0.19: MuP's output scaling
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for k, hidden_sbh in enumerate(mtp_sbh):
        logits_sbv, _ = model.output_layer(
            hidden_sbh, weight=weight, runtime_gather_output=call.get("runtime_gather_output")
        )
        if scale_logits is not None:
            logits_sbv = scale_logits(logits_sbv)
        ce_sum, num_tokens = hook(k, logits_sbv)
        loss = ce_sum if config.calculate_per_token_loss else ce_sum / num_tokens.clamp(min=1)
        main_sbh = auto_scaler.apply(main_sbh, scale * loss)
    return main_sbh
