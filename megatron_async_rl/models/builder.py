"""Build a Megatron GPT model (a pipeline stage's model chunks) for a role from Megatron args.

Owned here: TransformerConfig from Megatron flags + the role's parallel layout, the layer spec
(Transformer Engine on a GPU when importable, local otherwise), the padded vocabulary, and the
`GPTModel` itself with the role's `ProcessGroupCollection`, with a scalar head in place of the
LM output layer when the spec has one (`models.heads`), and the multi-token-prediction block with
--mtp-num-layers (`mtp_block_spec`). Called by `roles.megatron_role`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import Any

import numpy as np
import torch

from megatron_async_rl.compat import megatron_fixes, megatron_mtp
from megatron_async_rl.config.megatron import core_kwargs
from megatron_async_rl.distributed.layout import Parallelism
from megatron_async_rl.distributed.platform import Platform
from megatron_async_rl.models import heads
from megatron_async_rl.models.dims import padded_vocab_size

logger = logging.getLogger(__name__)

# Fused kernels that need CUDA (or Apex/TE); turned off on CPU, left as the user set on GPU
# (on by default, as in Megatron-LM) except `_NEED_TE` without Transformer Engine.
_CPU_OFF = (
    "gradient_accumulation_fusion",
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "persist_layer_norm",
    "moe_grouped_gemm",
    "moe_permute_fusion",
    "cross_entropy_loss_fusion",
)

# Fusions whose kernels come from Transformer Engine or Apex (wgrad into main_grad, fused RoPE,
# the persistent layer norm, the fused masked softmax): off on a GPU without TE.
_NEED_TE = (
    "gradient_accumulation_fusion",
    "apply_rope_fusion",
    "persist_layer_norm",
    "masked_softmax_fusion",
)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a role's model is, independent of which stage this rank holds."""

    vocab_size: int  # the tokenizer's vocabulary
    padded_vocab_size: int  # divisible by make_vocab_size_divisible_by * tp
    max_sequence_length: int
    gpt_kwargs: dict
    use_te: bool
    head: str | None = None
    """A scalar head in place of the LM output layer (`models.heads`): "value", "score", or
    None for the LM head."""


def te_available(platform: Platform) -> bool:
    if not platform.use_cuda:
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_transformer_config(args: dict[str, Any], par: Parallelism, platform: Platform):
    kwargs = core_kwargs.transformer_config_kwargs(args)
    kwargs.update(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.etp,
        context_parallel_size=par.cp,
    )
    if args.get("bf16"):
        kwargs.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    else:
        kwargs.setdefault("params_dtype", torch.float32)
        kwargs["pipeline_dtype"] = kwargs["params_dtype"]
    if not platform.use_cuda:
        kwargs["use_cpu_initialization"] = True
        for name in _CPU_OFF:
            kwargs[name] = False
    if kwargs.get("use_te_rng_tracker") and not te_available(platform):
        raise ValueError(
            "--te-rng-tracker: Transformer Engine's RNG tracker needs Transformer Engine on a "
            "CUDA device; drop the flag"
        )
    elif not te_available(platform):
        off = [name for name in _NEED_TE if kwargs.get(name)]
        for name in off:
            kwargs[name] = False
        if off:
            logger.warning(
                "Transformer Engine is not importable: %s off (their kernels come from it)",
                ", ".join(off),
            )
    return core_kwargs.transformer_config_class(args)(**kwargs)


def model_spec(
    args: dict[str, Any], par: Parallelism, platform: Platform, head: str | None = None
) -> ModelSpec:
    """`head`: a scalar head (`models.heads`); its model has untied embeddings (the head is
    not the embedding's transpose), whatever --untie-embeddings-and-output-weights says."""
    heads.check_kind(head)
    gpt = core_kwargs.gpt_model_kwargs(args)
    if head is not None:
        gpt["share_embeddings_and_output_weights"] = False
    vocab = gpt.pop("vocab_size", None) or args.get("vocab_size")
    if not vocab:
        raise ValueError(
            "--vocab-size: the vocabulary size is unknown; set model.hf_path (its config.json "
            "gives it) or pass --vocab-size"
        )
    divisible_by = int(args.get("make_vocab_size_divisible_by") or 128)
    return ModelSpec(
        vocab_size=int(vocab),
        padded_vocab_size=padded_vocab_size(int(vocab), divisible_by, par.tp),
        max_sequence_length=int(gpt.pop("max_sequence_length")),
        gpt_kwargs=gpt,
        use_te=te_available(platform),
        head=head,
    )


def layer_spec(config, spec: ModelSpec, pp_rank: int = 0, vp_stage: int | None = None):
    """One layer spec for uniform models; megatron-core's block spec (this stage's layers, or
    model chunk `vp_stage`'s, each dense or MoE by --moe-layer-freq) for multi-latent
    attention, mixed dense/MoE stacks and --pipeline-model-parallel-layout."""
    from megatron.core.models.gpt import gpt_layer_specs

    freq = config.moe_layer_freq
    mixed = config.num_moe_experts and not (freq == 1 or (isinstance(freq, list) and 0 not in freq))
    if config.multi_latent_attention or mixed or config.pipeline_model_parallel_layout:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=spec.use_te, normalization=config.normalization,
            pp_rank=pp_rank, vp_stage=vp_stage,
        )  # fmt: skip
        return block if spec.use_te else megatron_fixes.mla_local_spec(block)

    common = dict(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
    )
    if spec.use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**common)
    return gpt_layer_specs.get_gpt_layer_local_spec(**common, normalization=config.normalization)


def mtp_block_spec(config, spec: ModelSpec, decoder_spec, pp_rank: int, vp_stage: int | None):
    """megatron-core's multi-token-prediction block spec (--mtp-num-layers: the MTP layers
    repeat the decoder's last layer spec), built on the role's groups (`compat.megatron_mtp`);
    None without MTP and on every pipeline stage but the last, which holds them all (without
    virtual stages: `config.megatron.rules`)."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    block = get_gpt_mtp_block_spec(
        config, decoder_spec, use_transformer_engine=spec.use_te, vp_stage=vp_stage,
        pp_rank=pp_rank,
    )  # fmt: skip
    return megatron_mtp.block_spec_with_groups(block)


def disable_jit_fuser() -> None:
    """--disable-jit-fuser, process-wide as in Megatron-LM: megatron-core's `jit_fuser` is
    `torch.compile` (torch >= 2.2) applied when its modules are imported, so besides its own
    switch (for modules imported later) TorchDynamo itself is disabled: the functions already
    decorated then run eagerly."""
    import torch._dynamo
    from megatron.core import jit

    jit.disable_jit_fuser()
    torch._dynamo.config.disable = True


def seed_generators(seed: int, pp_rank: int) -> None:
    """--seed seeds what Megatron-LM's `_set_random_seed` seeds: Python's and NumPy's
    generators (seed + 100 x pipeline rank, as there) and torch's. torch.cuda.manual_seed is a
    no-op on CPU torch: the CPU generator gets the seed itself, the same on every rank of the
    role, so use_cpu_initialization splits one master weight consistently. (The CUDA and
    tensor-parallel generators: `model_parallel_cuda_manual_seed`, by the caller.)"""
    random.seed(seed + 100 * pp_rank)
    np.random.seed(seed + 100 * pp_rank)
    torch.manual_seed(seed)


def build_gpt_chunks(config, spec: ModelSpec, pg_collection, seed: int, device=None) -> list:
    """The GPTModel model chunks held by this rank, in order: one, or one per virtual pipeline
    stage (`config.virtual_pipeline_model_parallel_size`: `GPTModel(vp_stage=v)`, as
    Megatron-LM's `get_model` builds them, the generators seeded once before the first). Pre
    and post process come from the PP rank and the chunk; each is moved whole to `device` (the
    rank's; as `get_model` does): modules that megatron-core builds on the CPU whatever the
    config (torch norms without TE, the MoE router) follow it."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    pp_rank = torch.distributed.get_rank(pg_collection.pp)
    pp_size = torch.distributed.get_world_size(pg_collection.pp)
    seed_generators(seed, pp_rank)
    # As Megatron-LM's `_set_random_seed`: TE's tracker with --te-rng-tracker.
    model_parallel_cuda_manual_seed(
        seed,
        te_rng_tracker=bool(config.use_te_rng_tracker),
        tp_rank=torch.distributed.get_rank(pg_collection.tp),
        ep_rank=torch.distributed.get_rank(pg_collection.ep),
        etp_rank=torch.distributed.get_rank(pg_collection.expt_tp),
        force_reset_rng=True,
    )
    vp_size = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for v in range(vp_size):
        vp_stage = v if vp_size > 1 else None
        decoder_spec = layer_spec(config, spec, pp_rank, vp_stage)
        with megatron_mtp.process_groups(pg_collection):
            model = GPTModel(
                config=config,
                transformer_layer_spec=decoder_spec,
                vocab_size=spec.padded_vocab_size,
                max_sequence_length=spec.max_sequence_length,
                pre_process=pp_rank == 0 and v == 0,
                post_process=pp_rank == pp_size - 1 and v == vp_size - 1,
                parallel_output=True,
                pg_collection=pg_collection,
                vp_stage=vp_stage,
                mtp_block_spec=mtp_block_spec(config, spec, decoder_spec, pp_rank, vp_stage),
                **spec.gpt_kwargs,
            )
        if spec.head is not None:
            heads.attach_scalar_head(model, config, spec.head, pg_collection.tp, seed)
        if device is not None and torch.device(device).type != "cpu":
            model = model.to(device)
        chunks.append(model)
    return chunks
