"""The stages of one GRPO step, shared by the synchronous and the asynchronous loop.

Owned here: what each side of a step does, independent of when it runs.
- `Job.setup`: roles, checkpoints, tokenizer, dataset, engine, reward, metrics writer.
- `Job.rollout`: generate ranks turn the step's prompts into scored samples (generate, reward).
- `Job.learn`: Megatron ranks turn the step's samples into one optimizer step (batch layout,
  logp, ref, advantages, train); results cross Megatron ranks over the `megatron` group only, so
  generate ranks never take part and can run ahead.
- `Job.log_step`: the leader merges reports and writes `metrics.jsonl`.
Called by `jobs/grpo_sync.py` (stages in turn) and `jobs/grpo_async.py` (generation overlapped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_async_rl.algorithms import grpo, losses
from megatron_async_rl.observability.metrics import MetricsWriter, StepTimer, summarize
from megatron_async_rl.observability.plots import plot_reward_curve, plot_stage_timeline
from megatron_async_rl.observability.progress import Progress
from megatron_async_rl.observability.trace import TraceRecorder, merge_traces, write_trace
from megatron_async_rl.observability.utilization import busy_idle
from megatron_async_rl.rewards.registry import SafeReward, get_reward
from megatron_async_rl.roles.megatron_role import build_local_roles
from megatron_async_rl.rollout.batch import build_batch, version_number
from megatron_async_rl.rollout.dataset import PromptDataset, encode_prompt
from megatron_async_rl.rollout.generation import Sample, generate_samples, served_prompts
from megatron_async_rl.rollout.validation import Validator
from megatron_async_rl.scheduler.machine import StageMachine
from megatron_async_rl.scheduler.states import Stage
from megatron_async_rl.weight_sync.buffers import BufferPool

logger = logging.getLogger(__name__)
LOSS_KEYS = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss")


WAIT_SPANS = frozenset({"wait_samples", "admit"})
"""Spans that record a wait, not work: they count as idle in `utilization/`."""


class Stages:
    """Times each stage for the step metrics and records its span for trace.json."""

    def __init__(self, rank: int, roles: tuple[str, ...]):
        self.rank, self.roles = rank, roles
        self.trace = TraceRecorder(rank, roles)
        self._since = time.time()

    def utilization(self) -> dict[str, float]:
        """This rank's busy and idle seconds and bubble ratio since the previous call
        (`utilization/<group>/...`; the leader averages them over each group's ranks)."""
        now, since = time.time(), self._since
        self._since = now
        if now <= since:
            return {}
        spans = [s for s in self.trace.spans(since_s=since) if s["stage"] not in WAIT_SPANS]
        return busy_idle(spans, since, now, {self.rank: self.roles})

    @contextlib.contextmanager
    def __call__(self, name: str, step: int, timer: StepTimer):
        with timer(name), self.trace.span(name, step=step):
            yield


def _reports(role) -> bool:
    """One rank per data-parallel replica reports a role's results: last stage, TP rank 0."""
    return role.is_last_stage and dist.get_rank(role.pgc.tp) == 0


def train_on_batch(role, batch, old_logp, ref_logp, adv, mask, cfg) -> dict:
    """The train role's step on its data-parallel share of the batch."""
    algo = cfg.algorithm
    dp_rank, dp_size = dist.get_rank(role.pgc.dp), dist.get_world_size(role.pgc.dp)
    rows = torch.arange(batch["tokens"].shape[0]).chunk(dp_size)[dp_rank]
    mbs = cfg.trainer.micro_batch_size or int(role.args.get("micro_batch_size") or 1)
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    fields = {
        "tokens": batch["tokens"], "mask": mask, "adv": adv, "old_logp": old_logp,
        "ref_logp": ref_logp, "behaviour_logp": batch["behaviour_logp"],
    }  # fmt: skip
    micro = [{k: v[chunk] for k, v in fields.items()} for chunk in rows.split(mbs)]

    def loss_fn(logp, entropy, mb):
        return losses.total_loss(
            logp, mb["old_logp"], mb["adv"], mb["mask"], algo,
            behaviour_logp_BT=mb["behaviour_logp"], ref_logp_BT=mb["ref_logp"],
            entropy_BT=entropy, num_tokens_global=num_tokens, num_seqs_global=num_seqs,
        )  # fmt: skip

    metrics = role.train_step(micro, loss_fn)
    for key in LOSS_KEYS:  # shares of the step's loss: sum over micro-batches
        if key in metrics:
            metrics[key] *= len(micro)
    return metrics


def merge_reports(parts) -> dict:
    """Merge per-rank reports: loss shares and counters summed, timings max, the rest mean."""
    merged: dict[str, float] = {}
    counts: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            if key in LOSS_KEYS or key.startswith(("data/", "reward/errors", "reward/calls")):
                merged[key] = merged.get(key, 0.0) + value
            elif key.startswith("timing/"):
                merged[key] = max(merged.get(key, 0.0), value)
            else:
                merged[key] = merged.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
    return {k: v / counts[k] if k in counts else v for k, v in merged.items()}


class Job:
    """Everything a GRPO run holds on one rank, and the stages it runs."""

    def __init__(self, cfg, groups, platform):
        from transformers import AutoTokenizer

        self.cfg, self.groups, self.platform = cfg, groups, platform
        self.rank = dist.get_rank()
        self.is_leader = self.rank == groups.leader
        self.roles = build_local_roles(cfg, groups, platform)
        for role in self.roles.values():
            role.load_hf_checkpoint(role.args.get("load") or cfg.model.hf_path)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self.dataset = PromptDataset(
            cfg.data, tokenizer=self.tokenizer, use_chat_template=cfg.rollout.use_chat_template
        )
        self.engine = self._start_engine()
        self.reward = SafeReward(get_reward(cfg.reward), cfg.reward.name) if self.engine else None
        self.validator = self._validator()
        self.validation_machine = StageMachine(Stage.VALIDATION)
        self.weight_buffers = BufferPool()
        """This rank's weight-sync buffers, reused from one version to the next."""
        self.writer = MetricsWriter(cfg.run_dir) if self.is_leader else None
        self.progress = Progress(cfg.trainer.num_steps, enabled=self.is_leader)
        self.stages = Stages(self.rank, groups.local_roles())
        self.steps_logged = 0

    def engine_index(self) -> tuple[int, int]:
        """(this rank's engine among all engines, how many engines): prompts are shared by
        engine, not by generate rank (an engine of engine.tp_size spans that many ranks)."""
        hosts = self.groups.layout.engine_host_ranks()
        return hosts.index(self.rank), len(hosts)

    def _start_engine(self):
        layout = self.groups.layout
        if "generate" not in self.groups.local_roles() or not layout.is_engine_host(self.rank):
            return None  # an engine follower: its devices belong to its host's engine
        from megatron_async_rl.engines.sglang_engine import SGLangEngine

        rank_in_role = self.groups.layout.rank_in_role("generate", self.rank)
        config = self.cfg.engine.sglang_config(
            self.cfg.model.hf_path, self.platform.device_type, self.cfg.seed
        )
        if self.platform.device_type == "cuda":  # the engine's TP ranks start at our device
            config.server_args.setdefault("base_gpu_id", int(os.environ.get("LOCAL_RANK", "0")))
        engine = SGLangEngine(config, rank_in_role=rank_in_role, global_rank=self.rank)
        logger.info("generate rank %d: engine up in %.1f s", rank_in_role, engine.startup_s)
        return engine

    def _validator(self) -> Validator | None:
        cfg = self.cfg
        if self.engine is None or cfg.scheduler.validation_every == 0:
            return None
        val = cfg.validation
        dataset = PromptDataset(
            val.data, tokenizer=self.tokenizer, use_chat_template=cfg.rollout.use_chat_template,
            key_prefix="validation.data",
        )  # fmt: skip
        records = dataset.records[: val.num_prompts] if val.num_prompts else dataset.records
        return Validator(
            val, cfg.rollout, records, SafeReward(get_reward(cfg.reward), cfg.reward.name),
            *self.engine_index(), cfg.seed,
        )  # fmt: skip

    # -- generate ranks ---------------------------------------------------------------------
    def validate(self, version: int, step: int, timer: StepTimer) -> dict:
        """The validation stage: the held-out set scored with the engine's current weights
        (policy `version`); the caller moves `validation_machine` around it."""
        with self.stages("validation", step, timer):
            metrics = self.validator.run(
                self.engine, self.tokenizer, version,
                lambda r: encode_prompt(r, self.tokenizer, self.cfg.rollout.use_chat_template),
            )  # fmt: skip
        metrics.update(self.validation_machine.metrics())
        return metrics

    def rollout(self, step: int, records, timer: StepTimer) -> tuple[list[Sample], dict]:
        """This generate rank's share of the step's samples, scored; and its report."""
        return self.score(step, self.generate(step, records, timer), timer)

    def generate(self, step: int, records, timer: StepTimer) -> list[Sample]:
        """The generate stage: this rank's share of the step's prompts, sampled."""
        cfg = self.cfg
        mine = served_prompts(len(records), *self.engine_index())
        ids = {
            i: records[i].prompt_ids
            or encode_prompt(records[i], self.tokenizer, cfg.rollout.use_chat_template)
            for i in mine
        }
        n = cfg.algorithm.num_samples_per_prompt
        with self.stages("generate", step, timer):
            return generate_samples(
                self.engine, self.tokenizer, records, ids, mine, n, cfg.rollout,
                step=step, run_seed=cfg.seed,
            )  # fmt: skip

    def score(self, step: int, samples: list[Sample], timer: StepTimer):
        """The reward stage: every sample scored; (samples, this rank's reward report)."""
        with self.stages("reward", step, timer):
            for sample, value in zip(samples, self.reward.score(samples), strict=True):
                sample.reward = value
        return samples, self.reward.metrics()

    # -- Megatron ranks ---------------------------------------------------------------------
    def learn(self, step: int, samples: list[Sample], timer: StepTimer) -> tuple[dict, dict]:
        """One optimizer step from the step's samples; (this rank's report, batch metrics)."""
        return self.train(self.forward("ref", self.forward("logp", {
            "step": step, "samples": samples, "timer": timer,
            "batch": build_batch(samples, self.pad_id), "results": {},
        })))  # fmt: skip

    def forward(self, name: str, state: dict) -> dict:
        """The `logp` or `ref` stage: that role's log-probs of the batch (on its ranks)."""
        role = self.roles.get(name)
        if role is not None:
            size = self.cfg.trainer.micro_batch_size or len(state["samples"])
            with self.stages(name, state["step"], state["timer"]):
                out = role.logprobs(state["batch"]["tokens"], size)
            if out is not None and _reports(role) and dist.get_rank(role.pgc.dp) == 0:
                state["results"][name] = out[0]
        return state

    def train(self, state: dict) -> tuple[dict, dict]:
        """Advantages and the train role's optimizer step (collective over the Megatron ranks)."""
        cfg, algo, roles = self.cfg, self.cfg.algorithm, self.roles
        n = algo.num_samples_per_prompt
        step, samples, timer = state["step"], state["samples"], state["timer"]
        batch = state["batch"]
        parts = [None] * len(self.groups.megatron_ranks)
        dist.all_gather_object(parts, state["results"], group=self.groups.megatron)
        merged = {k: v for part in parts for k, v in part.items()}
        old_logp, ref_logp = merged["logp"], merged["ref"]
        rewards, mask = batch["rewards"], batch["mask"]
        if algo.kl_mode == "reward" and algo.kl_coef > 0:
            kl = grpo.kl_penalty(old_logp, ref_logp, algo.kl_estimator)
            rewards = grpo.kl_reward(rewards, kl, mask, algo.kl_coef)
        dropped = 0
        if algo.dynamic_filtering:
            keep, dropped = grpo.dynamic_filter(rewards, n)
            mask = mask * keep[:, None]
        adv = grpo.group_advantages(
            rewards, n, normalize_by_std=algo.normalize_advantage_by_std, eps=algo.advantage_eps
        )
        report = {}
        if "train" in roles:
            with self.stages("train", step, timer):
                metrics = train_on_batch(roles["train"], batch, old_logp, ref_logp, adv, mask, cfg)
            if _reports(roles["train"]):
                report.update(metrics)
        real = batch["mask"] > 0
        batch_metrics = {
            **summarize(batch["rewards"].tolist(), "reward"),
            **summarize(batch["response_len"].tolist(), "response_len"),
            "logprob/engine_vs_train_abs_diff": (
                (batch["behaviour_logp"] - old_logp).abs()[real].mean().item()
            ),
            "samples/kept": float((mask.sum(-1) > 0).sum().item()),
            "samples/truncated": float(sum(s.finish_reason == "length" for s in samples)),
            "data/dropped_groups": float(dropped),
            "tokens/total": (batch["prompt_len"].sum() + batch["response_len"].sum()).item(),
        }
        return report, batch_metrics

    def log_step(
        self, step: int, report: dict, batch_metrics: dict, step_s: float, gen_reports=()
    ) -> None:
        """Gather Megatron ranks' reports on the leader (with the generate ranks' reports that
        came with the samples) and write the step's metrics."""
        report = {**report, **self.stages.utilization()}
        parts = [None] * len(self.groups.megatron_ranks)
        dist.gather_object(report, parts if self.is_leader else None, dst=self.groups.leader,
                           group=self.groups.megatron)  # fmt: skip
        if not self.is_leader:
            return
        metrics = merge_reports([*parts, *gen_reports])
        metrics.update(batch_metrics)
        metrics.update(self.dataset.metrics())
        metrics["timing/step_s"] = step_s
        busy = [v for k, v in metrics.items() if k.startswith("utilization/") and "busy_s" in k]
        if busy:  # the busiest group bounds a perfectly overlapped step
            metrics["utilization/ideal_step_s"] = max(busy)
            metrics["utilization/overlap_efficiency"] = min(max(busy) / step_s, 1.0)
        metrics["throughput/tokens_per_s"] = metrics.pop("tokens/total") / step_s
        self.writer.log(step, metrics)
        self.progress.update(step, metrics)
        self.steps_logged += 1

    # -- end of run ---------------------------------------------------------------------------
    def write_trace(self) -> None:
        """Merge every rank's spans into trace.json and timeline.png (collective, world)."""
        parts = [None] * dist.get_world_size(self.groups.control)
        payload = (self.stages.trace.events(), self.stages.trace.spans())
        dist.gather_object(payload, parts if self.is_leader else None, dst=self.groups.leader,
                           group=self.groups.control)  # fmt: skip
        if not self.is_leader:
            return
        run_dir = Path(self.cfg.run_dir)
        write_trace(run_dir / "trace.json", merge_traces([events for events, _ in parts]))
        spans = [span for _, rank_spans in parts for span in rank_spans]
        plot_stage_timeline(spans, run_dir / "timeline.png", title="stages per rank (trace.json)")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.progress.close()
        if self.writer is not None:
            self.writer.close()
        if self.steps_logged:  # never let a plot hide the error that ended the run
            plot_reward_curve(
                Path(self.cfg.run_dir) / "metrics.jsonl", Path(self.cfg.run_dir) / "reward.png",
                title="GRPO reward (mean per step)", std_band=False, moving_average=10,
            )  # fmt: skip


def exchange_samples(groups, samples: list[Sample], report: dict):
    """All ranks get every engine's samples (in prompt order) and reports (`samples` group;
    engine followers are not in it and get nothing)."""
    if groups.samples is None:
        return [], []
    parts = [None] * dist.get_world_size(groups.samples)
    dist.all_gather_object(parts, ([s.to_dict() for s in samples], report), group=groups.samples)
    merged = sorted(
        (Sample(**d) for dicts, _ in parts for d in dicts),
        key=lambda s: (s.prompt_index, s.sample_index),
    )
    return merged, [r for _, r in parts if r]


def token_versions(samples: list[Sample]) -> list[list[int]]:
    """Policy version of every response token, per sample."""
    return [[version_number(v) for v in s.token_versions] for s in samples]
