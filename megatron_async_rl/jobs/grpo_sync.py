"""The synchronous GRPO loop: one policy version per step, every stage in turn.

    dataloader -> generate -> reward -> logp -> ref -> advantages -> train -> weight sync
    (all ranks)   (generate ranks)      (logp)  (ref)  (all ranks)   (train)  (-> generate, logp)

Owned here: the order of the stages of one step and what moves between ranks. Called by the
entry point on every rank (`trainer.job: grpo`). Every rank draws the same prompts from the
same seeded dataset; generate ranks sample and score their share; samples and log-probs cross
roles over the gloo control group (Python objects; small at these sizes); advantages are
computed identically on every rank; the train role steps; the new weights go to the engines
and the logp role (`weight_sync.broadcast`). This loop is also the exact reference for the
asynchronous pipeline at zero steps ahead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_async_rl.algorithms import grpo, losses
from megatron_async_rl.observability.metrics import MetricsWriter, StepTimer, summarize
from megatron_async_rl.observability.plots import plot_reward_curve, plot_stage_timeline
from megatron_async_rl.observability.progress import Progress
from megatron_async_rl.observability.trace import TraceRecorder, merge_traces, write_trace
from megatron_async_rl.rewards.registry import SafeReward, get_reward
from megatron_async_rl.roles.megatron_role import build_local_roles
from megatron_async_rl.rollout.batch import build_batch
from megatron_async_rl.rollout.dataset import PromptDataset, encode_prompt
from megatron_async_rl.rollout.generation import Sample, generate_samples, served_prompts
from megatron_async_rl.weight_sync.broadcast import sync_weights

logger = logging.getLogger(__name__)
LOSS_KEYS = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy_loss")


def _all_gather(obj, groups) -> list:
    parts = [None] * dist.get_world_size(groups.control)
    dist.all_gather_object(parts, obj, group=groups.control)
    return parts


class _Stages:
    """Times each stage for the step metrics and records its span for trace.json."""

    def __init__(self, rank: int, roles: tuple[str, ...]):
        self.trace = TraceRecorder(rank, roles)
        self.timer = StepTimer(rank=rank)

    def new_step(self) -> None:
        self.timer = StepTimer(rank=self.trace.rank)

    @contextlib.contextmanager
    def __call__(self, stage: str, step: int):
        with self.timer(stage), self.trace.span(stage, step=step):
            yield


def _write_trace(cfg, groups, stages: _Stages) -> None:
    """Merge every rank's spans into <run_dir>/trace.json and draw timeline.png (collective)."""
    parts = [None] * dist.get_world_size(groups.control)
    payload = (stages.trace.events(), stages.trace.spans())
    dist.gather_object(payload, parts if dist.get_rank() == 0 else None, dst=0,
                       group=groups.control)  # fmt: skip
    if dist.get_rank() != 0:
        return
    run_dir = Path(cfg.run_dir)
    write_trace(run_dir / "trace.json", merge_traces([events for events, _ in parts]))
    spans = [span for _, rank_spans in parts for span in rank_spans]
    plot_stage_timeline(spans, run_dir / "timeline.png", title="stages per rank (trace.json)")


def _reports(role) -> bool:
    """One rank per data-parallel replica reports a role's results: last stage, TP rank 0."""
    return role.is_last_stage and dist.get_rank(role.pgc.tp) == 0


def start_engine(cfg, groups, platform):
    """This rank's SGLang engine when it is a generate rank, else None."""
    if "generate" not in groups.local_roles():
        return None
    from megatron_async_rl.engines.sglang_engine import SGLangEngine

    rank = dist.get_rank()
    rank_in_role = groups.layout.rank_in_role("generate", rank)
    config = cfg.engine.sglang_config(cfg.model.hf_path, platform.device_type, cfg.seed)
    engine = SGLangEngine(config, rank_in_role=rank_in_role, global_rank=rank)
    logger.info("generate rank %d: engine up in %.1f s", rank_in_role, engine.startup_s)
    return engine


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


def _batch_metrics(batch, samples, old_logp, mask, step) -> dict:
    real = batch["mask"] > 0
    metrics = {}
    metrics.update(summarize(batch["rewards"].tolist(), "reward"))
    metrics.update(summarize(batch["response_len"].tolist(), "response_len"))
    metrics["logprob/engine_vs_train_abs_diff"] = (
        (batch["behaviour_logp"] - old_logp).abs()[real].mean().item()
    )
    lag = (step - batch["versions"])[real].float()
    metrics["policy_lag/max"], metrics["policy_lag/mean"] = lag.max().item(), lag.mean().item()
    metrics["samples/kept"] = float((mask.sum(-1) > 0).sum().item())
    metrics["samples/truncated"] = float(sum(s.finish_reason == "length" for s in samples))
    return metrics


def _merge_reports(parts) -> dict:
    merged: dict[str, float] = {}
    counts: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            if key in LOSS_KEYS or key.startswith("data/") or key.startswith("reward/e"):
                merged[key] = merged.get(key, 0.0) + value
            elif key.startswith("timing/"):
                merged[key] = max(merged.get(key, 0.0), value)
            else:
                merged[key] = merged.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
    return {k: v / counts[k] if k in counts else v for k, v in merged.items()}


def run_grpo(cfg, groups, platform) -> None:
    """Train for `trainer.num_steps` steps (collective over the world)."""
    from transformers import AutoTokenizer

    rank = dist.get_rank()
    roles = build_local_roles(cfg, groups, platform)
    for role in roles.values():
        role.load_hf_checkpoint(role.args.get("load") or cfg.model.hf_path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dataset = PromptDataset(cfg.data, tokenizer=tokenizer,
                            use_chat_template=cfg.rollout.use_chat_template)  # fmt: skip
    engine = start_engine(cfg, groups, platform)
    reward = SafeReward(get_reward(cfg.reward), name=cfg.reward.name) if engine else None
    writer = MetricsWriter(cfg.run_dir) if rank == 0 else None
    progress = Progress(cfg.trainer.num_steps, enabled=rank == 0)
    stage = _Stages(rank, groups.local_roles())
    num_gen = groups.layout.window_of("generate").size
    dist.barrier(group=groups.control)  # engines are up: step timings start clean
    n = cfg.algorithm.num_samples_per_prompt
    try:
        for step in range(cfg.trainer.num_steps):
            start = time.perf_counter()
            stage.new_step()
            records = dataset.next_batch(cfg.rollout.num_prompts_per_step)
            samples: list[Sample] = []
            if engine is not None:
                mine = served_prompts(len(records), groups.layout.rank_in_role("generate", rank),
                                      num_gen)  # fmt: skip
                ids = {
                    i: records[i].prompt_ids
                    or encode_prompt(records[i], tokenizer, cfg.rollout.use_chat_template)
                    for i in mine
                }
                with stage("generate", step):
                    samples = generate_samples(
                        engine,
                        tokenizer,
                        records,
                        ids,
                        mine,
                        n,
                        cfg.rollout,
                        step=step,
                        run_seed=cfg.seed,
                    )
                with stage("reward", step):
                    for sample, value in zip(samples, reward.score(samples), strict=True):
                        sample.reward = value
            parts = _all_gather([s.to_dict() for s in samples], groups)
            samples = sorted((Sample(**d) for part in parts for d in part),
                             key=lambda s: (s.prompt_index, s.sample_index))  # fmt: skip
            batch = build_batch(samples, pad_id)
            mbs = cfg.trainer.micro_batch_size
            results = {}
            for name in ("logp", "ref"):
                if name in roles:
                    role = roles[name]
                    with stage(name, step):
                        out = role.logprobs(batch["tokens"], mbs or len(samples))
                    if out is not None and _reports(role) and dist.get_rank(role.pgc.dp) == 0:
                        results[name] = out[0]
            merged = {k: v for part in _all_gather(results, groups) for k, v in part.items()}
            old_logp, ref_logp = merged["logp"], merged["ref"]

            rewards, mask = batch["rewards"], batch["mask"]
            algo = cfg.algorithm
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
                with stage("train", step):
                    train = train_on_batch(roles["train"], batch, old_logp, ref_logp, adv, mask,
                                           cfg)  # fmt: skip
                if _reports(roles["train"]):
                    report.update(train)
            with stage("weight_sync", step):
                report.update(sync_weights(groups, roles, engine, version=step + 1))
            report.update(stage.timer.metrics(prefix="timing"))
            if reward is not None:
                report.update(reward.metrics())
            parts = [None] * dist.get_world_size(groups.control)
            dist.gather_object(report, parts if rank == 0 else None, dst=0, group=groups.control)
            if rank == 0:
                step_s = time.perf_counter() - start
                metrics = _merge_reports(parts)
                metrics.update(_batch_metrics(batch, samples, old_logp, mask, step))
                metrics.update(dataset.metrics())
                metrics["data/dropped_groups"] = float(dropped)
                metrics["timing/step_s"] = step_s
                tokens = batch["prompt_len"].sum() + batch["response_len"].sum()
                metrics["throughput/tokens_per_s"] = tokens.item() / step_s
                writer.log(step, metrics)
                progress.update(step, metrics)
        _write_trace(cfg, groups, stage)
    finally:
        if engine is not None:
            engine.shutdown()
        progress.close()
        if writer is not None:
            writer.close()
    if rank == 0:
        plot_reward_curve(Path(cfg.run_dir) / "metrics.jsonl", Path(cfg.run_dir) / "reward.png",
                          title="GRPO reward (mean per step)", std_band=False,
                          moving_average=10)  # fmt: skip
