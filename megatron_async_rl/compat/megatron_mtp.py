"""Multi-token prediction (--mtp-num-layers) on explicit process groups, returning logits.

Owned here: what megatron-core 0.16.1 needs to build and run a GPTModel's MTP block inside a
role built from explicit process groups, whose global `parallel_state` is never initialised,
and the one change of behaviour an RL actor needs. Installed by `megatron_fixes.install` (every
platform, before a model is built); used by `models.builder` (building) and
`roles.megatron_role` (the actor's train step). Each patch is idempotent.

Defects, each an AssertionError or None-group error at build or first forward without them:
- `GPTModel.__init__` builds `MultiTokenPredictionBlock(config, spec, vp_stage)` without its
  `pg_collection`, so the block asks the global state for one. Inside `process_groups(pgc)`
  (the builder's) a block built without groups takes `pgc`. The block also has no `tp_group`,
  so `MegatronModule.sharded_state_dict` (every checkpoint save and load) asks the global
  state for it: the block gets the collection's.
- `MultiTokenPredictionLayer` builds its `eh_proj` (a ColumnParallelLinear) without a TP group
  and its transformer layer without the collection, and gathers `eh_proj`'s output with
  `gather_from_tensor_model_parallel_region(x)` (no group). `block_spec_with_groups` builds
  `LayerWithGroups` instead, which hands the collection and TP group to both and supplies its
  own TP group to that gather (and to the sequence-parallel scatter after it).
- `MultiTokenPredictionLayer` asks `get_transformer_layer_offset(config, vp_stage)` without a
  pipeline rank, and `get_mtp_num_layers_to_build` asks the global state whether this is the
  last stage. Both are answered from the role's pipeline group (the collection of
  `process_groups`): the MTP layers are built on its last stage. Virtual stages and a custom
  layout are refused with MTP (`config.megatron_rules`).
With pipeline size > 1 the last stage also holds a copy of the word embedding (the MTP layers
embed the shifted tokens); megatron-core ties it to the first stage's through the collection's
`embd` group (`setup_embeddings_and_output_layer`, and `finalize_model_grads` all-reduces the
two copies' gradients), as for a tied output layer: no global state read there. With tied
embeddings that stage also allocates an output-layer weight it never uses, whose sharded state
dict megatron-core asserts absent: it is checkpointed as a replica of the first stage's
embedding (`_install_tied_state_dict`).

Behaviour. megatron-core's `GPTModel._postprocess` computes the MTP loss only from `labels`
(and crashes without them), logs it through the global data-parallel group, and returns the
main head's cross-entropy instead of its logits. The RL loss needs the logits (temperature,
entropy, clipping), so an MTP model's `_postprocess` is wrapped:
- inside `loss_hook(hook)` (the actor's train step) the MTP layers run on the decoder's output,
  each layer k's logits come from the shared output layer, `hook(k, logits_sbv)` gives
  (sum of the cross-entropy over the tokens it counts, their number), and the loss is attached
  to the main hidden states with megatron-core's `MTPLossAutoScaler`, scaled by
  mtp_loss_scaling_factor / mtp_num_layers, as a mean over the counted tokens (their sum with
  --calculate-per-token-loss), as megatron-core does; the schedule sets the scaler's backward
  scale per micro-batch, as for Megatron-LM;
- outside it (forward-only passes, the logp of the train role) the MTP layers do not run;
- either way megatron-core's own `_postprocess` then computes the main head's logits, with the
  config's `mtp_num_layers` unset for that call, so the logits are those of the same model
  without MTP layers.
Calls with `labels` (not made in this package) go to megatron-core unchanged.

Shapes: s, b, h, v megatron-core's [sequence, batch, hidden, vocab shard].
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect

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


def install() -> None:
    """Apply the patches (idempotent)."""
    from megatron.core.models.gpt import gpt_layer_specs, gpt_model
    from megatron.core.transformer import multi_token_prediction as mtp

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

    count = mtp.get_mtp_num_layers_to_build

    @functools.wraps(count)
    def layers_to_build(config, vp_stage=None, pp_rank=None):
        stage = _pipeline_stage(config, pp_rank)
        if stage is None:
            return count(config, vp_stage=vp_stage, pp_rank=pp_rank)
        rank, size = stage
        return (config.mtp_num_layers or 0) if rank == size - 1 else 0  # the last stage's

    for module in (mtp, gpt_layer_specs):
        if getattr(module, "get_mtp_num_layers_to_build", None) is count:
            module.get_mtp_num_layers_to_build = layers_to_build

    offset = mtp.get_transformer_layer_offset

    @functools.wraps(offset)
    def layer_offset(config, vp_stage=None, pp_rank=None):
        stage = _pipeline_stage(config, pp_rank)
        if pp_rank is None and stage is not None:
            pp_rank = stage[0]  # the role's rank, not the global state's
        return offset(config, vp_stage, pp_rank)

    mtp.get_transformer_layer_offset = layer_offset
    for name in ("gather_from_tensor_model_parallel_region", "scatter_to_sequence_parallel_region"):
        setattr(mtp, name, _group_defaults_to_layer_tp(getattr(mtp, name)))
    _install_postprocess(gpt_model.GPTModel)
    _install_tied_state_dict(gpt_model.GPTModel)


def _install_tied_state_dict(gpt_model_cls) -> None:
    """With tied embeddings, the MTP stage (pipeline size > 1) of megatron-core 0.16.1 still
    allocates the output layer's weight (`skip_weight_param_allocation` is `pre_process` and
    tied) but computes its logits with its copy of the embedding, and its sharded state dict
    asserts that weight absent (the optimizer's then misses it). The unused weight is
    checkpointed as megatron-core does for a tied last stage without MTP: a replica of the
    first stage's embedding, never saved, loaded equal to it (as HF loading fills it)."""
    from megatron.core.utils import get_pg_rank, make_tp_sharded_tensor_for_checkpoint

    original = gpt_model_cls.tie_embeddings_and_output_weights_state_dict

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

    gpt_model_cls.tie_embeddings_and_output_weights_state_dict = tie


def _pipeline_stage(config, pp_rank: int | None) -> tuple[int, int] | None:
    """(pipeline rank, pipeline size) of the model being built, from `pp_rank` or the role's
    collection (`process_groups`); None where megatron-core's own answer is kept (a custom
    layout or virtual stages, refused with MTP by `config.megatron_rules`, or outside a
    role's build with more than one stage)."""
    if config.pipeline_model_parallel_layout is not None:
        return None
    size = config.pipeline_model_parallel_size
    if size == 1:
        return 0, 1  # one stage: it is the first and the last whatever the global state says
    if config.virtual_pipeline_model_parallel_size:
        return None
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
    `LayerWithGroups`. Returns the same object, edited."""
    if block_spec is None:
        return None
    layer_cls = _layer_with_groups()
    for layer_spec in block_spec.layer_specs:
        layer_spec.module = layer_cls
    return block_spec


def _install_postprocess(gpt_model_cls) -> None:
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    original = gpt_model_cls._postprocess
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

    gpt_model_cls._postprocess = postprocess


def _attach_mtp_loss(model, call: dict, hook, auto_scaler):
    """The main hidden states [s, b, h], carrying each MTP layer's scaled loss for backward."""
    config = model.config
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
        **(call.get("extra_block_kwargs") or {}),
    )
    main_sbh, *mtp_sbh = stacked_sbh.chunk(1 + config.mtp_num_layers, dim=0)
    weight = None
    if model.share_embeddings_and_output_weights:
        weight = model.shared_embedding_or_output_weight()
    scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
    for k, hidden_sbh in enumerate(mtp_sbh):
        logits_sbv, _ = model.output_layer(
            hidden_sbh, weight=weight, runtime_gather_output=call.get("runtime_gather_output")
        )
        ce_sum, num_tokens = hook(k, logits_sbv)
        loss = ce_sum if config.calculate_per_token_loss else ce_sum / num_tokens.clamp(min=1)
        main_sbh = auto_scaler.apply(main_sbh, scale * loss)
    return main_sbh
