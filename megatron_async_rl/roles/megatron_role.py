"""One Megatron role on this rank: its model stage, weights, and (for `train`) DDP + optimizer.

Owned here: building a role's model from resolved Megatron args and its `RoleGroups`; loading a
HuggingFace checkpoint shard by shard; computing per-token log-probs of a token batch through
the role's pipeline (forward only). Called by the entry point for each Megatron role that lives
on this rank. `train` gets `DistributedDataParallel` (megatron-core's FSDP2 wrapper with
--use-torch-fsdp2: `models.torch_fsdp2`), Megatron's optimizer and its lr schedule
(`roles.lr_schedule`), its param-group map written with --dump-param-to-param-group-map
(`roles.param_groups`), all wired by `roles.megatron_wrap`; `logp` and `ref` are forward-only,
and `ref` is frozen (requires_grad False).

With --mtp-num-layers the train role's model carries multi-token-prediction layers, trained in
`train_step` beside the RL loss (`algorithms.mtp`, `compat.megatron_mtp`; `actor/mtp_loss`); the
logp and ref roles leave them out.

A role built with a scalar head (`head`, `models.heads`: a critic's "value", a reward model's
"score") has no logits: `values` / `scores` and `train_step(outputs="values")` instead.

With virtual pipeline stages (--num-virtual-stages-per-pipeline-rank V > 1) a rank holds V model
chunks (`chunks`; `models`, each in its own DDP wrapper for a trained role), run by megatron-core's
interleaved schedule with one data iterator per chunk over the same micro-batches (whose count
`algorithms.minibatch.check_virtual_pipeline_microbatches` checks first).

Batch tensors: tokens_BT (int64, right-padded), logp_BT / entropy_BT for positions 1..T-1
(column t is the log-prob of tokens[:, t + 1]); values_BT for positions 0..T-1 (column t is the
value after tokens[:, :t + 1], so values_BT[:, :-1] lines up with logp_BT); scores_B.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_async_rl.algorithms import minibatch, mtp
from megatron_async_rl.algorithms.logprobs import vocab_parallel_logprobs
from megatron_async_rl.compat import megatron_mtp
from megatron_async_rl.config.errors import warn_once
from megatron_async_rl.config.megatron import rules
from megatron_async_rl.config.roles import TRAINED_ROLES
from megatron_async_rl.distributed import devices
from megatron_async_rl.distributed.groups import MEGATRON_ROLES, RoleGroups, WorldGroups
from megatron_async_rl.distributed.layout import Parallelism
from megatron_async_rl.distributed.platform import Platform
from megatron_async_rl.models import builder, heads, weights
from megatron_async_rl.models.dims import moe_layer_pattern
from megatron_async_rl.moe import aux_metrics
from megatron_async_rl.roles import lr_schedule, megatron_wrap

logger = logging.getLogger(__name__)


class MegatronRole:
    """A role's model stage on this rank."""

    lr_scheduler = None
    gather_after_step = False
    moe_aux_names: list[str] = []
    """The MoE auxiliary losses this role's routers record in train steps (`moe.aux_metrics`)."""
    mask_moe_padding = False
    """An MoE model's train steps pass the batch's `padding` (bool [b, T], True at pads) to
    the routers, which leave pads out of the auxiliary losses and expert-bias counts."""
    """--overlap-param-gather with the distributed optimizer: all-gather the updated weights
    right after each optimizer step (`train_step`)."""
    """megatron-core's OptimizerParamScheduler (train only), one step per applied update."""
    head: str | None = None
    """"value" or "score": a scalar head in place of the LM output layer (`models.heads`)."""
    mtp_num_layers = 0
    """The model's multi-token-prediction layers (--mtp-num-layers; the train role only)."""

    def __init__(
        self,
        role: str,
        args: dict[str, Any],
        par: Parallelism,
        groups: RoleGroups,
        platform: Platform,
        seed: int,
        *,
        total_optimizer_steps: int | None = None,
        routing: bool = False,
        router_noise: float = 0.0,
        head: str | None = None,
    ):
        """`total_optimizer_steps`: the run's optimizer steps, the train role's lr decay horizon
        when neither --lr-decay-iters nor --train-iters is set; None and neither set: the lr
        stays constant after the warm-up (`lr_schedule`). `routing`: put replay slots on the
        MoE routers (`moe.replay`; `self.routing`, falsy on a dense model), `router_noise`
        their induced mismatch (`faults.router_noise`). `head`: "value" or "score" for a
        scalar head in place of the LM output layer (`models.heads`), None for the LM."""
        if not groups.is_member:
            raise RuntimeError(f"role {role}: rank {dist.get_rank()} is not in its window")
        if role in ("logp", "ref") and args.get("mtp_num_layers") is not None:
            # MTP layers train with the actor only; these roles' log-probs are the main head's
            # (`config.megatron.rules` says so once), and their pipeline layout places none
            args = {**args, "mtp_num_layers": None}
            if args.get("pipeline_model_parallel_layout") is not None:
                args["pipeline_model_parallel_layout"] = rules.layout_without_mtp(
                    args["pipeline_model_parallel_layout"]
                )
        self.role, self.args, self.par, self.platform = role, args, par, platform
        self.logprobs_in_fp32 = not args.get("fp16_lm_cross_entropy")
        """False with --fp16-lm-cross-entropy: log-probs in the logits' dtype (saves memory)."""
        if args.get("disable_jit_fuser"):
            builder.disable_jit_fuser()
        self.device = platform.device()
        """Where the model lives; every input enters through `devices.to_device`."""
        self.pgc = groups.pg_collection
        self.config = builder.build_transformer_config(args, par, platform)
        if args.get("num_experts"):
            self.mask_moe_padding = not self.config.sequence_parallel
            if self.config.sequence_parallel:
                warn_once(
                    "--sequence-parallel: pad positions count in the MoE auxiliary losses "
                    "(megatron-core 0.16.1 scatters the routers' padding mask over its global "
                    "tensor-parallel group, which roles built from explicit groups lack)"
                )
        self.head, self.seed = head, seed
        self.spec = builder.model_spec(args, par, platform, head)
        self.chunks = builder.build_gpt_chunks(self.config, self.spec, self.pgc, seed, self.device)
        """This rank's model chunks (GPTModels) in order: one, or one per virtual pipeline stage
        (--num-virtual-stages-per-pipeline-rank: chunk v holds virtual stage v x pp + pp_rank)."""
        self.mtp_num_layers = self.config.mtp_num_layers or 0
        self.models = list(self.chunks)
        """The chunks as the schedule runs them (each in its DDP wrapper for a trained role)."""
        self.pp_rank = dist.get_rank(self.pgc.pp)
        self.is_last_stage = self.pp_rank == par.pp - 1
        self.routing = None
        """`moe.replay.RoleRouting` of this stage's MoE routers, when asked for."""
        if routing:
            self.routing = _role_routing(self.chunks, args, self.pgc, router_noise)
        self.optimizer = None
        if role in TRAINED_ROLES:  # the actor, and PPO's critic
            self.moe_aux_names = aux_metrics.tracked_names(args)
            if self.moe_aux_names:
                self.moe_layers = _moe_layers(args)
            megatron_wrap.wrap_for_training(self, total_optimizer_steps)
        else:
            for chunk in self.chunks:
                chunk.eval()
                if role in ("ref", "reward_model"):
                    for param in chunk.parameters():
                        param.requires_grad_(False)

    @property
    def module(self):
        """The model stage of a role of one model chunk (`chunks` with several)."""
        return self._one(self.chunks)

    @property
    def model(self):
        """`module` as the schedule runs it (`models` with several chunks)."""
        return self._one(self.models)

    def _one(self, chunks: list):
        if len(chunks) != 1:
            raise RuntimeError(
                f"role {self.role} (global rank {dist.get_rank()}) holds {len(chunks)} model "
                "chunks (virtual pipeline stages): use its `chunks` / `models`"
            )
        return chunks[0]

    # ------------------------------------------------------------------------------------------
    def load_hf_checkpoint(self, path: str, head_init_std: float | None = None) -> None:
        """Load this rank's shard of every parameter from a HuggingFace directory (reading only
        the tensors of its stage and experts). `head_init_std`: with a scalar head, initialise
        head tensors the checkpoint lacks (a policy's: N(0, std^2), 0: zeros; `models.heads`)."""
        read, num_mtp_loaded = weights.load_hf_into_megatron(
            self.chunks, path, self.args, self.pgc, self.spec, head_init_std=head_init_std,
            head_seed=self.seed,
        )  # fmt: skip
        logger.info("role %s: read %.1f MB of %s for this rank's stage", self.role, read / 2**20,
                    path)  # fmt: skip
        if num_mtp_loaded < self.mtp_num_layers:
            if weights.model_dims(self.args, self.spec).hf_mtp_layers:
                why = (f"the checkpoint carries {num_mtp_loaded} (DeepSeek-V3's "
                       f"num_nextn_predict_layers, model.layers.{self.config.num_layers} on); "
                       f"HF export writes all {self.mtp_num_layers}")  # fmt: skip
            else:
                why = ("this family's HF format has no MTP names (DeepSeek-V3's has), so HF "
                       "export leaves them out")  # fmt: skip
            logger.warning(
                "role %s: MTP layers %d to %d of the %d (--mtp-num-layers) start freshly "
                "initialised (seed %d): %s; the role's Megatron checkpoints keep them", self.role,
                num_mtp_loaded, self.mtp_num_layers - 1, self.mtp_num_layers, self.seed, why,
            )  # fmt: skip
        if self.optimizer is not None:
            # The optimizer keeps fp32 main params; refresh them from the loaded model params.
            self.optimizer.reload_model_params()

    def gather_hf_state_dict(self):
        """The whole model in HF names on the role's first rank (collective over the role)."""
        return weights.gather_hf_state_dict(self.chunks, self.args, self.pgc, self.spec)

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _forward_only(self, tokens_BT: torch.Tensor, micro_batch_size: int, reduce,
                      routing: dict | None = None):  # fmt: skip
        """Run the role's pipeline forward; `reduce(logits, tokens)` -> dict, per micro-batch.

        Returns the per-micro-batch dicts on the last stage, None on other stages. Every rank of
        the role must call it with the same batch (data-parallel replicas too). `routing`: the
        MoE routers' work (`_route`).
        """
        tokens_BT = devices.to_device(tokens_BT, self.device)
        batch, seq_len = tokens_BT.shape
        if batch % micro_batch_size:
            raise ValueError(
                f"--micro-batch-size = {micro_batch_size}: must divide the batch size {batch}"
            )
        positions = _positions(micro_batch_size, seq_len, tokens_BT.device)
        routing = self._routing_pass(routing)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            self._route(mb, routing)
            tokens = mb["tokens"]
            logits_BTV = model(tokens, positions, attention_mask=None)
            return logits_BTV, lambda logits: (logits.new_zeros(()), reduce(logits, tokens))

        for model in self.models:
            model.eval()
        micro_batches = _split({"tokens": tokens_BT, **(routing or {})}, micro_batch_size)
        outputs = self._run_schedule(forward_step, micro_batches, seq_len, micro_batch_size, True)
        return outputs if self.is_last_stage else None

    def _routing_pass(self, routing: dict | None) -> dict | None:
        """The routing tensors of a pass (`replay`, `compare`: [B, T, L, K] expert ids,
        `valid`: [B, T]) and whether to record, checked; slots reset."""
        if not routing:
            return None
        if not self.routing:
            raise RuntimeError(f"role {self.role}: routing given, but no MoE routers to replay")
        self.routing.reset()
        return {k: v for k, v in routing.items() if v is not None}

    def _route(self, mb: dict, routing: dict | None) -> None:
        """Set the routers for micro-batch `mb` (before its forward)."""
        if routing:
            self.routing.micro_batch(
                replay_bSLK=mb.get("replay"), compare_bSLK=mb.get("compare"),
                valid_bS=mb.get("valid"), record=bool(routing.get("record")),
                keep_for_backward=bool(routing.get("backward")), device=self.device,
            )  # fmt: skip

    def _run_schedule(self, forward_step, micro_batches, seq_len, mb_size, forward_only):
        """Megatron's pipeline schedule over this role's stages, with its own groups."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        vp_size = len(self.models)
        data_iterator = iter(micro_batches)
        if vp_size > 1:  # the interleaved schedule: each chunk reads every micro-batch in turn
            minibatch.check_virtual_pipeline_microbatches(
                len(micro_batches), mb_size, self.par.pp, vp_size,
                self.config.microbatch_group_size_per_vp_stage, f"role {self.role}",
            )  # fmt: skip
            data_iterator = [iter(micro_batches) for _ in self.models]
        forward_backward = get_forward_backward_func(
            pp_size=self.par.pp, vp_size=vp_size if vp_size > 1 else None
        )
        return forward_backward(
            forward_step_func=forward_step,
            data_iterator=data_iterator,
            model=self.models,
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            micro_batch_size=mb_size,
            forward_only=forward_only,
            p2p_communicator=P2PCommunicator(pp_group=self.pgc.pp, config=self.config),
            pg_collection=self.pgc,
        )

    def logprobs(
        self, tokens_BT: torch.Tensor, micro_batch_size: int, routing: dict | None = None
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Per-token log-probs and entropies of `tokens_BT` on the last stage, else None.
        `routing` (MoE): `replay` / `compare` [B, T, L, K], `valid` [B, T], `record` (bool);
        the counts and recordings are then in `self.routing`."""
        self._check_head(None, "logprobs")
        tp_group, vocab_size = self.pgc.tp, self.spec.vocab_size

        def reduce(logits, tokens):
            logp, entropy = vocab_parallel_logprobs(
                logits[:, :-1], tokens[:, 1:], tp_group=tp_group, vocab_size=vocab_size,
                fp32=self.logprobs_in_fp32,
            )
            return {"logp": logp, "entropy": entropy}

        outputs = self._forward_only(tokens_BT, micro_batch_size, reduce, routing)
        if outputs is None:
            return None
        return torch.cat([o["logp"] for o in outputs]), torch.cat([o["entropy"] for o in outputs])

    def full_logits(self, tokens_BT: torch.Tensor, micro_batch_size: int):
        """Logits over the real vocabulary, gathered across TP, on the last stage, else None."""
        self._check_head(None, "full_logits")
        tp_group, vocab_size = self.pgc.tp, self.spec.vocab_size

        def reduce(logits, tokens):
            shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(shards, logits.contiguous(), group=tp_group)
            return {"logits": torch.cat(shards, dim=-1)[..., :vocab_size]}

        outputs = self._forward_only(tokens_BT, micro_batch_size, reduce)
        return None if outputs is None else torch.cat([o["logits"] for o in outputs])

    def values(self, tokens_BT: torch.Tensor, micro_batch_size: int) -> Optional[torch.Tensor]:
        """values_BT of a "value" head (fp32; every position, pads too) on the last stage,
        else None."""
        self._check_head("value", "values")
        outputs = self._forward_only(
            tokens_BT, micro_batch_size, lambda out, tokens: {"values": out[..., 0].float()}
        )
        return None if outputs is None else torch.cat([o["values"] for o in outputs])

    def scores(
        self, tokens_BT: torch.Tensor, pad_id: int, micro_batch_size: int
    ) -> Optional[torch.Tensor]:
        """scores_B of a "score" head: its output at each row's last token that is not
        `pad_id` (HF `*ForSequenceClassification`), fp32, on the last stage, else None."""
        self._check_head("score", "scores")
        heads.last_non_pad_index(tokens_BT, pad_id)  # every rank refuses a bad batch up front

        def reduce(out, tokens):
            return {"scores": heads.pool_last_non_pad(out[..., 0].float(), tokens, pad_id)}

        outputs = self._forward_only(tokens_BT, micro_batch_size, reduce)
        return None if outputs is None else torch.cat([o["scores"] for o in outputs])

    def _check_head(self, head: str | None, what: str) -> None:
        if self.head != head:
            has = f"a {self.head} head" if self.head else "the LM head"
            raise RuntimeError(
                f"role {self.role} (global rank {dist.get_rank()}): {what} needs "
                f"{f'a {head} head' if head else 'the LM head'}, this model has {has}"
            )

    # ------------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict], loss_fn, outputs: str = "logprobs") -> dict:
        """One optimizer step over `micro_batches` (gradient accumulation); train role only.

        Each micro-batch is a dict with `tokens` [b, T] and whatever `loss_fn` needs.
        `loss_fn(logp_BT, entropy_BT, micro_batch) -> (loss, metrics)` runs on the last stage
        with differentiable per-token log-probs; its loss must already be normalised over the
        WHOLE step (all micro-batches of all data-parallel ranks, e.g. by global token
        counts), so that summing micro-batch losses over the step gives the step's loss.
        `outputs="values"` (a "value" head): `loss_fn(values_BT, None, micro_batch)` instead,
        with differentiable values (as `values` computes them), same normalisation.
        Megatron's schedule divides each micro-batch loss by the number of micro-batches and
        DDP averages gradients over data-parallel ranks; both are undone here so gradients are
        those of that summed loss. Returns metrics: `actor/grad_norm`, `actor/update_ok`,
        `actor/lr` and `actor/wd` (the lr and weight decay THIS step's update used, read before
        the schedule advances; the lr of the default param groups, the weight decay before each
        group's wd_mult) and the loss_fn metrics averaged over micro-batches (on the last
        stage). The lr schedule advances after an applied update (by the step's samples over
        --global-batch-size: one step but while a batch ramp runs); a skipped one
        (update_ok False: the grad scaler found an inf or NaN) leaves it where it is, as
        Megatron-LM does. With --mtp-num-layers each micro-batch must carry `padding` (bool
        [b, T], True at pads): the MTP layers train on its real tokens beside `loss_fn`'s loss
        (`algorithms.mtp`), and the metrics add `actor/mtp_loss`.
        """
        if self.optimizer is None:
            raise RuntimeError(f"role {self.role}: train_step needs the train role's optimizer")
        if outputs not in ("logprobs", "values"):
            raise ValueError(f"outputs={outputs!r}: train_step gives 'logprobs' or 'values'")
        self._check_head("value" if outputs == "values" else None, f"train_step({outputs})")
        micro_batches = devices.to_device(micro_batches, self.device)
        num_micro = len(micro_batches)
        mb_size, seq_len = micro_batches[0]["tokens"].shape
        scale = float(num_micro * dist.get_world_size(self.pgc.dp))
        positions = _positions(mb_size, seq_len, micro_batches[0]["tokens"].device)
        tp_group, vocab_size = self.pgc.tp, self.spec.vocab_size
        mtp_log = mtp.MTPLossLog.for_step(self, micro_batches)

        routing = None
        if micro_batches[0].get("replay") is not None:  # replayed MoE routing (R3, R2)
            # a forward recomputed in the backward pass replays the same experts again
            recompute = bool(self.args.get("recompute_granularity"))
            routing = self._routing_pass({"replay": True, "backward": recompute})

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            self._route(batch, routing)
            tokens = batch["tokens"]
            padding = batch.get("padding") if self.mask_moe_padding else None
            extra = {} if padding is None else {"padding_mask": padding}
            trains_mtp = contextlib.nullcontext()
            if mtp_log is not None:  # the MTP layers' loss joins the backward (`algorithms.mtp`)
                trains_mtp = megatron_mtp.loss_hook(mtp_log.hook(tokens, batch["padding"]))
            with trains_mtp:
                logits = model(tokens, positions, attention_mask=None, **extra)

            def loss_func(logits_BTV):
                if outputs == "values":  # [b, T, 1] from the value head
                    loss, metrics = loss_fn(logits_BTV[..., 0], None, batch)
                    return loss * scale, {k: float(v) for k, v in metrics.items()}
                logp, entropy = vocab_parallel_logprobs(
                    logits_BTV[:, :-1], tokens[:, 1:], tp_group=tp_group, vocab_size=vocab_size,
                    fp32=self.logprobs_in_fp32,
                )
                loss, metrics = loss_fn(logp, entropy, batch)
                return loss * scale, {k: float(v) for k, v in metrics.items()}

            return logits, loss_func

        for model in self.models:
            model.train()
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe_aux_names:
            aux_metrics.clear()
        step_outputs = self._run_schedule(forward_step, micro_batches, seq_len, mb_size, False)
        update_ok, grad_norm, _ = self.optimizer.step()
        if self.gather_after_step:
            # The distributed optimizer leaves the updated shards' all-gather to the next
            # forward; the weights are read right after the step here (weight sync, export,
            # checkpoint), so gather now, as Megatron-LM does before it saves or evaluates.
            for model in self.models:
                model.start_param_sync(force_sync=True)
        metrics = {"actor/grad_norm": float(grad_norm or 0.0), "actor/update_ok": float(update_ok)}
        if self.lr_scheduler is not None:  # None only in a role built without __init__ (fakes)
            # Read before the schedule advances: the lr and weight decay this update used.
            metrics["actor/lr"], metrics["actor/wd"] = lr_schedule.current_lr_and_wd(
                self.lr_scheduler
            )
            if update_ok:  # by G_k / G: see lr_schedule (1 but while a batch ramp runs)
                step_samples = sum(len(mb["tokens"]) for mb in micro_batches)
                step_samples *= dist.get_world_size(self.pgc.dp)
                self.lr_scheduler.step(
                    increment=lr_schedule.scheduler_increment(self.args, step_samples)
                )
        if step_outputs:
            for key in step_outputs[0]:
                metrics[key] = sum(o[key] for o in step_outputs) / len(step_outputs)
        if self.moe_aux_names:  # the routers' auxiliary losses, as Megatron-LM logs them
            aux = aux_metrics.step_metrics(
                self.moe_aux_names, self.moe_layers, self.config.num_layers, num_micro, self.pgc,
                self.device, bool(self.args.get("moe_per_layer_logging")),
            )  # fmt: skip
            metrics.update({f"actor/{key}": value for key, value in aux.items()})
        if mtp_log is not None:
            metrics.update(mtp_log.metrics(self.pgc.dp, self.device, pp_group=self.pgc.pp))
        return metrics


def _positions(batch: int, seq_len: int, device) -> torch.Tensor:
    return torch.arange(seq_len, device=device).unsqueeze(0).expand(batch, seq_len)


def _split(batch: dict, size: int) -> list[dict]:
    """Micro-batches of `size` rows of every tensor of `batch` (other values copied)."""
    rows = batch["tokens"].shape[0]
    return [
        {k: v[i : i + size] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        for i in range(0, rows, size)
    ]


def _role_routing(chunks: list, args: dict, pgc, noise: float = 0.0):
    """Replay slots on the MoE routers of this stage (`moe.replay`), or None (dense model)."""
    if not args.get("num_experts"):
        return None
    from megatron_async_rl.moe.replay import RoleRouting

    sequence_parallel = bool(args.get("sequence_parallel"))
    return RoleRouting(chunks, _moe_layers(args), pgc.tp, sequence_parallel, noise)


def _moe_layers(args: dict) -> list[int]:
    """The global indices of the MoE layers (--moe-layer-freq over --num-layers)."""
    pattern = moe_layer_pattern(args.get("moe_layer_freq") or 1, int(args["num_layers"]))
    return [i for i, moe in enumerate(pattern) if moe]


def build_local_roles(
    cfg, groups: WorldGroups, platform: Platform, total_optimizer_steps: int | None = None
) -> dict[str, MegatronRole]:
    """Build every Megatron role placed on this rank, in a fixed order (train, logp, ref);
    `total_optimizer_steps` goes to the train role's lr schedule (`MegatronRole`)."""
    local = groups.local_roles()
    roles = {}
    for name in MEGATRON_ROLES:
        if name in local:
            roles[name] = MegatronRole(
                name,
                cfg.role_megatron_args[name],
                groups.layout.parallelism[name],
                groups.roles[name],
                platform,
                seed=int(cfg.role_megatron_args[name].get("seed") or cfg.seed),
                total_optimizer_steps=total_optimizer_steps,
                routing=_routes(cfg.moe, name, cfg.faults.router_noise),
                router_noise=cfg.faults.router_noise if name in ("train", "logp") else 0.0,
                head=ROLE_HEADS.get(name),
            )
    return roles


ROLE_HEADS = {"critic": "value", "reward_model": "score"}
"""The roles whose model ends in a scalar head (`models.heads`) instead of the LM head."""


def role_checkpoint(cfg, name: str, args: dict) -> tuple[str, float | None]:
    """Where role `name` loads its weights from, and the std of a head the checkpoint lacks:
    --load, else the reward model's own checkpoint, a critic's `critic.init` (its head drawn
    with `critic.value_head_init_std` when it starts from the policy), else model.hf_path."""
    if args.get("load"):
        return args["load"], cfg.critic.value_head_init_std if name == "critic" else None
    if name == "reward_model":
        return cfg.reward_model.hf_path, None
    if name == "critic":
        init = cfg.critic.init
        return (cfg.model.hf_path if init == "policy" else init), cfg.critic.value_head_init_std
    return cfg.model.hf_path, None


def _routes(moe, role: str, noise: float = 0.0) -> bool:
    """Whether `role` needs replay slots (`moe.config`): train to replay (r3, r2); logp to
    replay (r3), record (r2) or measure agreement; never ref. With `faults.router_noise`,
    train and logp route through them."""
    if role == "train":
        return moe.routing_replay != "off" or noise > 0
    return role == "logp" and (moe.routing_replay != "off" or moe.routing_metrics or noise > 0)
