"""The learn side on the Megatron ranks: a step's samples to log-probs, advantages, its
optimizer steps (PPO mini-batches), and the step's metrics.

Owned here: `LearnSide`, its stages as methods `StepWork -> StepWork` (`logp`, `ref`,
`reward_model`, `critic_values`, `train`, `critic_train`: their order is the jobs'
`learn_stages`), its guards `logp_waits_for` and
`critic_waits_for`, and `log` (the leader writes `metrics.jsonl`). Results cross the
Megatron ranks over the `megatron` group only, so generate ranks never take part and can run
ahead. Called by both loops in `jobs/`; weights leave through the loops' exchange.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from megatron_async_rl.algorithms import advantages, corrections, grpo, losses, minibatch, passes
from megatron_async_rl.algorithms.config import check_overlong_budget, response_budget
from megatron_async_rl.distributed import devices
from megatron_async_rl.models.names import chunk_name
from megatron_async_rl.moe.routing import agreement_metrics, routing_counts
from megatron_async_rl.observability.ledger import PromptLedger
from megatron_async_rl.observability.metrics import MetricsWriter, summarize
from megatron_async_rl.observability.plots import plot_reward_curve
from megatron_async_rl.observability.progress import Progress
from megatron_async_rl.observability.rollouts import dump_rollouts
from megatron_async_rl.roles import critic
from megatron_async_rl.roles.work import StepReport, StepWork
from megatron_async_rl.rollout.agentic import ratio_metrics
from megatron_async_rl.rollout.batch import build_batch, padding_BT

logger = logging.getLogger(__name__)

ZERO_VARIANCE_WARN = 0.75
"""Share of a step's groups with one reward for all samples above which the leader warns."""

LOSS_KEYS = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss")
"""Each data-parallel replica reports its share of these: the leader adds them up."""


def _reports(role) -> bool:
    """One rank per data-parallel replica reports a role's results: last stage, TP rank 0."""
    return role.is_last_stage and dist.get_rank(role.pgc.tp) == 0


def train_on_batch(role, work: StepWork, cfg) -> dict:
    """The train role's optimizer steps of one RL step, each on its data-parallel share of a
    mini-batch.

    Advantages and old/ref log-probs come computed over the whole batch; `algorithms.minibatch`
    plans the optimizer steps (B / --global-batch-size per epoch, `algorithm.ppo_epochs` epochs;
    unset: one step over the whole batch). Each step's loss is normalised over its own
    mini-batch's tokens or sequences on every data-parallel rank, so a plan of one whole-batch
    step is exactly the single step. Metrics: each step's as `train_step` reports them, averaged
    over the steps, except `actor/lr*` and `actor/wd*` (the last step's); `actor/grad_norm_max`,
    `actor/optimizer_steps` (the count) and `actor/global_batch_size` (this RL step's G: it
    follows --rampup-batch-size, `minibatch.global_batch_size_at`; B when G is unset).
    """
    algo, batch = cfg.algorithm, work.batch
    dp_size = dist.get_world_size(role.pgc.dp)
    mbs = int(role.args.get("micro_batch_size") or 1)  # trainer.micro_batch_size is folded in
    plan = minibatch.plan_role_step(role.args, batch["tokens"].shape[0], algo, cfg.seed,
                                    work.step, dp_size)  # fmt: skip
    if work.logp_BT is None and len(plan) != 1:  # old_logprobs trainer: checked at load
        raise RuntimeError(
            f"step {work.step}: algorithm.old_logprobs is trainer, and this step plans "
            f"{len(plan)} optimizer steps: only the first would have its old log-probs"
        )  # fmt: skip
    fields = {
        "tokens": batch["tokens"], "mask": work.loss_mask_BT, "adv": work.adv_B,
        "old_logp": work.logp_BT, "ref_logp": work.ref_logp_BT,
        "behaviour_logp": batch["behaviour_logp"],
    }  # fmt: skip
    fields = {k: v for k, v in fields.items() if v is not None}  # trainer: no old_logp
    fields.update(_replay_fields(cfg.moe.routing_replay, batch))
    if role.mask_moe_padding or role.args.get("mtp_num_layers"):  # MoE routers, MTP targets
        fields["padding"] = padding_BT(batch)
    skip = set(role.args.get("iterations_to_skip") or ())
    first = work.step * len(plan)  # Megatron-LM's 0-based iteration of this RL step's first
    # Dr. GRPO's constant divisor of a sequence's token sum: the run's response budget
    norm = response_budget(cfg)[1] if algo.loss_agg_mode == "seq-mean-token-sum-norm" else None
    steps = [
        _optimizer_step(role, fields, torch.tensor(samples), mbs, algo, norm)
        for i, samples in enumerate(plan)
        if first + i not in skip  # --iterations-to-skip: no update there, the schedule waits
    ]
    if len(steps) < len(plan):
        logger.warning("step %d: skipped optimizer iterations %s (--iterations-to-skip)", work.step,
                       sorted(i for i in range(first, first + len(plan)) if i in skip))  # fmt: skip
    size = {"actor/global_batch_size": float(len(plan[0]))}  # the G of this RL step
    if not steps:
        return {"actor/optimizer_steps": 0.0, **size}
    return {**_merge_steps(steps), **size}


def _replay_fields(mode: str, batch: dict) -> dict:
    """The train passes' MoE routing (`moe.config`): r3 replays the engine's (where it routed),
    r2 the logp pass's; off: nothing."""
    if mode == "r3":
        if batch.get("routing") is None:
            raise RuntimeError("moe.routing_replay is r3, and the batch has no engine routing")
        return {"replay": batch["routing"], "valid": batch["routing_valid"]}
    if mode == "r2":
        return {"replay": batch["replay_routing"]}
    return {}


def _optimizer_step(
    role, fields: dict, samples: torch.Tensor, mbs: int, algo, token_sum_norm: int | None
) -> dict:
    """One optimizer step on the mini-batch `samples` (row indices of the whole batch); its
    token and sequence counts are the loss's denominators on every micro-batch."""
    dp_rank, dp_size = dist.get_rank(role.pgc.dp), dist.get_world_size(role.pgc.dp)
    mask = fields["mask"][samples]
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    rows = samples.chunk(dp_size)[dp_rank]
    micro = [{k: v[chunk] for k, v in fields.items()} for chunk in rows.split(mbs)]

    def loss_fn(logp, entropy, mb):
        # old_logprobs trainer: this forward is the old policy's (one step, the same weights)
        old = mb["old_logp"] if "old_logp" in mb else logp.detach()
        return losses.total_loss(
            logp, old, mb["adv"], mb["mask"], algo,
            behaviour_logp_BT=mb["behaviour_logp"], ref_logp_BT=mb.get("ref_logp"),
            entropy_BT=entropy, num_tokens_global=num_tokens, num_seqs_global=num_seqs,
            token_sum_norm=token_sum_norm,
        )  # fmt: skip

    metrics = role.train_step(micro, loss_fn)
    for key in LOSS_KEYS:  # shares of the step's loss: sum over micro-batches
        if key in metrics:
            metrics[key] *= len(micro)
    return metrics


def memory_hygiene(args: dict, step: int, after: str) -> None:
    """Megatron-LM's --manual-gc, --empty-unused-memory-level and --train-sync-interval around
    our stages: with --manual-gc the automatic collector is off (`LearnSide`) and `gc.collect()`
    runs after the train stage every --manual-gc-interval RL steps (Megatron-LM counts
    iterations); level >= 1 empties the CUDA cache after the train stage, level 2 after the
    logp/ref forwards too; the device is synchronised after the train stage every
    --train-sync-interval RL steps."""
    sync = args.get("train_sync_interval")
    if after == "train" and sync and step % sync == 0 and torch.cuda.is_available():
        torch.cuda.synchronize()
    if after == "train" and args.get("manual_gc"):
        interval = args.get("manual_gc_interval") or 0
        if interval and step % interval == 0:
            gc.collect()
    level = args.get("empty_unused_memory_level") or 0
    if torch.cuda.is_available() and level >= (1 if after == "train" else 2):
        torch.cuda.empty_cache()


def check_replicas_agree(role, step: int) -> None:
    """Megatron-LM's --check-weight-hash-across-dp-replicas-interval: every that many RL steps,
    the train role's data-parallel replicas compare a hash of their parameters (collective over
    the role's DP group) and the run stops if one differs."""
    interval = role.args.get("check_weight_hash_across_dp_replicas_interval")
    if not interval or step % interval:
        return
    digest = xxhash.xxh3_64()
    named = (
        (chunk_name(name, v, len(role.chunks)), param)
        for v, chunk in enumerate(role.chunks)
        for name, param in chunk.named_parameters()
    )
    for name, param in sorted(named, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(param.detach().float().cpu().numpy().tobytes())
    hashes = [None] * dist.get_world_size(role.pgc.dp)
    devices.all_gather_object(hashes, digest.hexdigest(), group=role.pgc.dp)
    if len(set(hashes)) > 1:
        raise RuntimeError(
            f"role train, step {step}: the data-parallel replicas' weights differ (hashes "
            f"{hashes}; --check-weight-hash-across-dp-replicas-interval {interval})"
        )


def _merge_steps(steps: list[dict]) -> dict:
    """One RL step's metrics from its optimizer steps' (see `train_on_batch`)."""
    merged = {}
    for key in dict.fromkeys(k for metrics in steps for k in metrics):
        values = [metrics[key] for metrics in steps if key in metrics]
        last = key.startswith(("actor/lr", "actor/wd"))  # where the schedule leaves the RL step
        merged[key] = values[-1] if last else sum(values) / len(values)
    merged["actor/grad_norm_max"] = max(metrics["actor/grad_norm"] for metrics in steps)
    merged["actor/optimizer_steps"] = float(len(steps))
    return merged


class LearnSide:
    """The Megatron roles of one rank (`train`, `logp`, `ref`: any of them) and the step's
    metrics writer on the leader."""

    def __init__(self, cfg, groups, roles: dict, pad_id: int, tokenizer=None):
        self.cfg, self.groups, self.roles, self.pad_id = cfg, groups, roles, pad_id
        self.tokenizer = tokenizer
        """Decodes the prompts of the rollout dumps (`observability.dump_rollouts_every`)."""
        self.is_leader = groups.rank == groups.leader
        self.writer = None
        if self.is_leader:  # W&B's run config: the resolved recipe the entry point wrote
            self.writer = MetricsWriter(cfg.run_dir, wandb=cfg.observability.wandb)
        self.ledger = PromptLedger(cfg.run_dir) if self.is_leader else None
        self.progress = Progress(cfg.trainer.num_steps, enabled=self.is_leader)
        self.logp_version = 0
        """The policy version the logp role holds (its weights come with every sync)."""
        self.critic_version = 0
        """Steps the critic has trained through (a resumed run starts at its version)."""
        self.steps_logged = 0
        self.pending_metrics: dict[str, float] = {}
        """Metrics to add to the next step logged (e.g. `resume/*`, `checkpoint/*`)."""
        self._quiet_until = 0
        """The zero-variance warning's next allowed step."""
        if any(role.args.get("manual_gc") for role in roles.values()):
            gc.disable()  # Megatron-LM's --manual-gc: collections at step ends only
            gc.collect()

    # -- guards ----------------------------------------------------------------------------
    def logp_waits_for(self, work: StepWork) -> str | None:
        """What the logp stage still waits for before `work` (None: nothing): the logp role
        must hold the version that step `work.step` trains from (where its pass runs)."""
        if self._logp_pass and self.logp_version < work.step:
            return f"logp weights v{work.step} (logp holds v{self.logp_version})"
        return None

    def critic_waits_for(self, work: StepWork) -> str | None:
        """What the critic_values stage still waits for before `work`: the critic trained
        through step `work.step - 1` (as in the synchronous loop, whatever steps ahead)."""
        if "critic" in self.roles and self.critic_version < work.step:
            return f"the critic trained through step {work.step - 1} (it holds " \
                f"v{self.critic_version})"  # fmt: skip
        return None

    def weights_synced(self, version: int) -> None:
        self.logp_version = version

    # -- stages ----------------------------------------------------------------------------
    @property
    def _logp_pass(self) -> bool:
        return "logp" in self.roles and self.cfg.algorithm.old_logprobs in ("logp", "auto")

    def logp(self, work: StepWork) -> StepWork:
        """logp: the batch laid out, and the old policy's log-probs (on the logp ranks, where
        `algorithm.old_logprobs` is logp; else `train` takes them: `_old_logprobs`)."""
        work.batch = build_batch(work.samples, self.pad_id)
        if self._logp_pass:
            work.logp_BT = self._forward("logp", work)
        return work

    def ref(self, work: StepWork) -> StepWork:
        """ref_logp: the reference policy's log-probs (on the ref ranks), on the steps that use
        them (`algorithms.passes.ref_runs`: a KL term, or every kl_metrics_every steps)."""
        if passes.ref_runs(self.cfg.algorithm, work.step):
            work.ref_logp_BT = self._forward("ref", work)
        return work

    def reward_model(self, work: StepWork) -> StepWork:
        """reward_model: the reward model's score of each sample (on its ranks)."""
        work.batch.update(critic.reward_scores(self.roles, work.batch, self.pad_id))
        return work

    def critic_values(self, work: StepWork) -> StepWork:
        """critic_values: the critic's values of the step's tokens (on its ranks), from the
        critic trained through step `work.step - 1` (`critic_waits_for`)."""
        work.batch.update(critic.critic_values(self.roles, work.batch))
        if "critic" in self.roles:
            memory_hygiene(self.roles["critic"].args, work.step, after="critic_values")
        return work

    def critic_train(self, work: StepWork) -> StepWork:
        """critic_train: the critic's optimizer steps on the returns the train stage computed
        (on its ranks, while the actor trains on its own)."""
        value_model = self.roles.get("critic")
        if value_model is not None:
            metrics = critic.train_critic(value_model, work, self.cfg)
            memory_hygiene(value_model.args, work.step, after="critic")
            if value_model.is_last_stage and dist.get_rank(value_model.pgc.tp) == 0:
                keys = critic.CRITIC_LOSS_KEYS
                work.report.add_sums({k: v for k, v in metrics.items() if k in keys})
                work.report.add_means({k: v for k, v in metrics.items() if k not in keys})
            self.critic_version = work.step + 1
        return work

    def _forward(self, name: str, work: StepWork) -> torch.Tensor | None:
        role = self.roles.get(name)
        if role is None:
            return None
        size = role.args.get("micro_batch_size") or len(work.samples)
        routing = self._routing(name, role, work.batch)
        out = role.logprobs(work.batch["tokens"], size, routing)
        if routing:
            self._routing_results(role, work, size, record=bool(routing.get("record")))
        memory_hygiene(role.args, work.step, after=name)
        if out is not None and _reports(role) and dist.get_rank(role.pgc.dp) == 0:
            return out[0]
        return None

    def _routing(self, name: str, role, batch: dict) -> dict | None:
        """What the logp pass does with MoE routing (`moe.config`): replay the engine's (r3),
        record its own (r2), and compare its own with the engine's (metrics). The ref role
        routes on its own and is not measured."""
        if name != "logp" or not role.routing:
            return None
        moe, engine = self.cfg.moe, batch.get("routing")
        if moe.routing_replay == "r3" and engine is None:
            raise RuntimeError(
                "moe.routing_replay is r3, and the step's samples came without the engines' "
                "routed experts (the engine must be started with them: see moe.routing)"
            )
        compare = engine if moe.routing_metrics else None
        routing = {
            "replay": engine if moe.routing_replay == "r3" else None,
            "compare": compare,
            "valid": batch.get("routing_valid") if engine is not None else None,
            "record": moe.routing_replay == "r2",
        }
        return routing if routing["replay"] is not None or compare is not None or \
            routing["record"] else None  # fmt: skip

    def _routing_results(self, role, work: StepWork, size: int, record: bool) -> None:
        """The logp pass's routing agreement counts into the step's report (once per token:
        data-parallel rank 0, and TP rank 0 unless sequence parallel splits the tokens), and
        its recording (r2) into `batch["replay_routing"]` on every logp rank."""
        counts = role.routing.take_counts()
        tp_rank = dist.get_rank(role.pgc.tp)
        if dist.get_rank(role.pgc.dp) == 0 and (tp_rank == 0 or role.routing.sequence_parallel):
            work.report.add_sums(routing_counts(counts))
        if record:
            from megatron_async_rl.moe.replay import gather_recorded

            recorded = role.routing.take_recorded(size)
            work.batch["replay_routing"] = gather_recorded(role.routing, recorded, role.pgc.pp)

    def train(self, work: StepWork) -> StepWork:
        """train: the rewards shaped, the loss mask filtered, advantages, and the optimizer steps
        (collective over the Megatron ranks). In order: DAPO's overlong penalty on the rewards
        and its truncation filter, the KL-in-reward penalty, dynamic filtering, the off-policy
        rejection mask, then `algorithm.advantage_estimator` over the final mask."""
        algo, batch = self.cfg.algorithm, work.batch
        mine = {
            k: v for k, v in (("logp", work.logp_BT), ("ref", work.ref_logp_BT)) if v is not None
        }
        if work.logp_BT is not None and batch.get("replay_routing") is not None:
            mine["replay_routing"] = batch["replay_routing"]  # r2: the logp pass's routing
        mine.update({k: batch[k] for k in ("old_values", "rm_scores") if k in batch})
        parts = [None] * len(self.groups.megatron_ranks)
        devices.all_gather_object(parts, mine, group=self.groups.megatron)
        merged = {k: v for part in parts for k, v in part.items()}
        work.logp_BT, work.ref_logp_BT = self._old_logprobs(merged, batch), merged.get("ref")
        batch["replay_routing"] = merged.get("replay_routing")
        batch.update({k: merged[k] for k in ("old_values", "rm_scores") if k in merged})
        rewards, mask = batch["rewards"], batch["mask"]
        if "rm_scores" in batch:  # a reward model's scores join the function's rewards
            batch["rule_rewards"] = rewards
            rewards = batch["rewards"] = critic.model_rewards(rewards, batch["rm_scores"],
                                                              self.cfg)  # fmt: skip
        budget_key, budget = response_budget(self.cfg)
        check_overlong_budget(algo, budget_key, budget)
        penalty = advantages.overlong_penalty(batch["response_len"], budget,
                                              algo.overlong_buffer_len,
                                              algo.overlong_penalty_factor)  # fmt: skip
        rewards = rewards + penalty
        truncated = torch.tensor([s.finish_reason == "length" for s in work.samples])
        if algo.mask_truncated:
            mask = mask * ~truncated[:, None]
        if algo.kl_mode == "reward" and algo.kl_coef > 0:
            kl = grpo.kl_penalty(work.logp_BT, work.ref_logp_BT, algo.kl_estimator)
            rewards = grpo.kl_reward(rewards, kl, mask, algo.kl_coef)
        dropped = 0
        n = algo.num_samples_per_prompt
        if algo.dynamic_filtering:
            keep, dropped = grpo.dynamic_filter(rewards, n)
            mask = mask * keep[:, None]
        accept = corrections.behaviour_mask(work.logp_BT, batch["behaviour_logp"], mask, algo) \
            if work.logp_BT is not None else torch.ones_like(mask, dtype=torch.bool)  # fmt: skip
        rejected = corrections.rejection_metrics(mask, accept)
        mask = mask * accept
        work.loss_mask_BT = mask
        if algo.advantage_estimator == "gae":  # PPO: per-token advantages from the critic
            work.adv_B, batch["returns"], gae_metrics = critic.gae_advantages(
                rewards, batch["mask"], mask, batch["old_values"], self.cfg
            )
            work.batch_metrics.update(gae_metrics)
        else:
            work.adv_B = advantages.compute_advantages(rewards, mask, n, algo)
        train = self.roles.get("train")
        warming = "old_values" in batch and work.step < self.cfg.critic.warmup_steps
        if train is not None and not warming:  # critic warm-up: the critic alone trains
            metrics = train_on_batch(train, work, self.cfg)
            memory_hygiene(train.args, work.step, after="train")
            check_replicas_agree(train, work.step)
            if _reports(train):
                work.report.add_sums({k: v for k, v in metrics.items() if k in LOSS_KEYS})
                work.report.add_means({k: v for k, v in metrics.items() if k not in LOSS_KEYS})
        real = batch["mask"] > 0
        if "rm_scores" in batch:  # the two parts of the reward, apart
            work.batch_metrics.update({
                **summarize(batch["rule_rewards"].tolist(), "reward/rule"),
                **summarize(batch["rm_scores"].tolist(), "reward_model/score"),
            })  # fmt: skip
        work.batch_metrics.update({
            **summarize(batch["rewards"].tolist(), "reward"),
            **summarize(batch["response_len"].tolist(), "response_len"),
            **self._mismatch_metrics(work, real, mask),
            **rejected,
            "reward/overlong_penalty_mean": penalty.mean().item(),
            "samples/masked_truncated": float(truncated.sum()) if algo.mask_truncated else 0.0,
            "samples/kept": float((mask.sum(-1) > 0).sum().item()),
            "samples/truncated": float(sum(s.finish_reason == "length" for s in work.samples)),
            "data/dropped_groups": float(dropped),
            "data/zero_variance_groups": self._zero_variance_share(batch["rewards"], n, work.step),
        })  # fmt: skip
        return work

    def _old_logprobs(self, merged: dict, batch: dict) -> torch.Tensor | None:
        """The step's old log-probs by `algorithm.old_logprobs`: the logp pass's, the engine's
        (behaviour), or None (trainer: the train forward's own, `train_on_batch`)."""
        source = self.cfg.algorithm.old_logprobs
        if source == "logp" or (source == "auto" and "logp" in merged):  # auto: logp if placed
            return merged["logp"]
        if source == "engine":
            return batch["behaviour_logp"]
        if source == "trainer":
            return None
        raise ValueError(f"algorithm.old_logprobs {source!r} was not resolved (recipe.load)")

    def _mismatch_metrics(self, work: StepWork, real, mask) -> dict[str, float]:
        """Engine vs trainer log-probs over the step's tokens, where a trainer pass measured
        them before training (the logp role's; with trainer, the loss's offpolicy/logp_*_gap
        are the same comparison, with engine there is none)."""
        if self.cfg.algorithm.old_logprobs in ("trainer", "engine"):
            return {}  # no trainer pass before the step
        engine = work.batch["behaviour_logp"]
        return {
            "logprob/engine_vs_train_abs_diff": (engine - work.logp_BT).abs()[real].mean().item(),
            **corrections.mismatch_metrics(work.logp_BT, engine, real),
            **corrections.mismatch_metrics(work.logp_BT, engine, mask > 0, "/trained"),
        }

    def _zero_variance_share(self, rewards, n: int, step: int) -> float:
        """Share of the step's GRPO groups whose samples all got the same reward (advantage 0:
        nothing to learn from them); the leader warns when most are, at most every 10 steps."""
        same = rewards.view(-1, n).amax(1) == rewards.view(-1, n).amin(1)
        share = float(same.float().mean())
        if self.is_leader and share > ZERO_VARIANCE_WARN and step >= self._quiet_until:
            self._quiet_until = step + 10
            logger.warning(
                "step %d: %d of %d groups got one reward for all their samples: nothing to "
                "learn from them (a task too easy or too hard for the model, or a reward that "
                "ignores the response? see reward/mean and the samples)", step,
                int(same.sum()), same.numel(),
            )  # fmt: skip
        return share

    # -- metrics ---------------------------------------------------------------------------
    def log(self, work: StepWork, step_s: float) -> None:
        """Gather the Megatron ranks' reports on the leader (with the engine hosts' reports that
        came with the samples) and write the step's metrics (collective, `megatron` group)."""
        parts = [None] * len(self.groups.megatron_ranks)
        devices.gather_object(work.report, parts if self.is_leader else None,
                              dst=self.groups.leader, group=self.groups.megatron)  # fmt: skip
        if not self.is_leader:
            return
        metrics = StepReport.merge([*parts, *work.gen_reports])
        metrics.update(ratio_metrics(metrics))  # multi-turn means from the engines' counts
        metrics.update(agreement_metrics(metrics))  # MoE routing agreement from the counts
        for key in [k for k in metrics if k.startswith(("moe/routing_matched/",
                                                         "moe/routing_used_matched/",
                                                         "moe/routing_tokens/"))]:
            del metrics[key]  # fmt: skip
        metrics.update(work.batch_metrics)
        metrics.update(self.pending_metrics)
        self.pending_metrics = {}
        metrics["timing/step_s"] = step_s
        busy = [v for k, v in metrics.items() if k.startswith("utilization/") and "busy_s" in k]
        if busy:  # the busiest group bounds a perfectly overlapped step
            metrics["utilization/ideal_step_s"] = max(busy)
            metrics["utilization/overlap_efficiency"] = min(max(busy) / step_s, 1.0)
        batch = work.batch
        tokens = (batch["prompt_len"].sum() + batch["response_len"].sum()).item()
        metrics["throughput/tokens_per_s"] = tokens / step_s
        self.writer.log(work.step, metrics)
        prompts = sorted({s.prompt_index: s.uid for s in work.samples}.items())
        per_sample = work.token_versions()
        every = self.cfg.observability.dump_rollouts_every
        if every and work.step % every == 0 and work.adv_B is not None:
            adv = work.adv_B
            if adv.dim() == 2:  # PPO's per-token advantages: each sample's mean over its tokens
                mask = work.loss_mask_BT
                adv = (adv * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            dump_rollouts(self.cfg.run_dir, work.step, work.samples, adv.tolist(),
                          per_sample, self.tokenizer)  # fmt: skip
        versions = [v for tokens in per_sample for v in tokens] or [work.step]
        self.ledger.log(work.step, [uid for _, uid in prompts], (min(versions), max(versions)))
        self.progress.update(work.step, metrics)
        show = self.cfg.observability.show_sample_every
        if show and work.step % show == 0 and work.samples:
            sample = work.samples[work.step % len(work.samples)]  # a different one each time
            prompt = self.tokenizer.decode(sample.prompt_ids) if self.tokenizer else None
            self.progress.sample(work.step, prompt, sample.response_text, sample.answer,
                                 sample.reward)  # fmt: skip
        self.steps_logged += 1

    def close(self) -> None:
        self.progress.close()
        if self.writer is not None:
            self.writer.close()
            self.ledger.close()
        if self.steps_logged:  # never let a plot hide the error that ended the run
            run_dir = Path(self.cfg.run_dir)
            plot_reward_curve(
                run_dir / "metrics.jsonl", run_dir / "reward.png",
                title="GRPO reward (mean per step)", std_band=False, moving_average=10,
            )  # fmt: skip
