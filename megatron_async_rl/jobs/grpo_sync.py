"""The synchronous GRPO loop: one policy version per step, every stage in turn.

    dataloader -> generate -> reward -> logp -> ref -> advantages -> train -> weight sync
    (all ranks)   (generate ranks)      (logp)  (ref)  (Megatron)    (train)  (-> generate, logp)

Owned here: the order of the stages of one step (the stages themselves are `jobs/stages.py`).
Called by the entry point on every rank (`trainer.job: grpo` with
`scheduler.generate_ahead_steps: 0`). Every rank draws the same prompts from the same seeded
dataset; generate ranks sample and score their share; samples reach every rank over the
`samples` group; Megatron ranks compute log-probs, advantages and the optimizer step; the new
weights go to the engines and the logp role. When a version is due for validation
(`scheduler.validation_every`), the generate ranks evaluate the held-out set with it before
they generate the step. This loop is the exact reference for the
asynchronous pipeline at zero steps ahead.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from megatron_async_rl.jobs.stages import Job, exchange_samples, token_versions
from megatron_async_rl.observability.metrics import StepTimer
from megatron_async_rl.scheduler.staleness import StalenessController
from megatron_async_rl.scheduler.states import StageState
from megatron_async_rl.weight_sync.broadcast import sync_weights


def run_grpo_sync(cfg, groups, platform) -> None:
    """Train for `trainer.num_steps` steps (collective over the world)."""
    job = Job(cfg, groups, platform)
    staleness = StalenessController(0)
    dist.barrier(group=groups.control)  # engines are up: step timings start clean
    try:
        for step in range(cfg.trainer.num_steps):
            start = time.perf_counter()
            timer = StepTimer(rank=job.rank)
            records = job.dataset.next_batch(cfg.rollout.num_prompts_per_step)
            samples, gen_report = [], {}
            if job.engine is not None:
                if job.validator is not None and cfg.scheduler.validation_due(step):
                    machine = job.validation_machine  # the engine holds v{step}: evaluate it
                    machine.transition(StageState.RUNNING, f"version {step} is due")
                    gen_report.update(job.validate(step, step, timer))
                    gen_report["val/due_version"] = float(step)
                    machine.transition(StageState.IDLE, f"version {step} evaluated")
                samples, report = job.rollout(step, records, timer)
                gen_report.update(report)
                if not job.roles:  # a rank with Megatron roles reports it in log_step
                    gen_report.update(job.stages.utilization())
                gen_report.update(timer.metrics(prefix="timing"))
            samples, gen_reports = exchange_samples(groups, samples, gen_report)
            report, batch_metrics = {}, {}
            if job.roles:
                report, batch_metrics = job.learn(step, samples, timer)
                batch_metrics.update(staleness.check_batch(step, token_versions(samples)))
            with job.stages("weight_sync", step, timer):
                report.update(
                    sync_weights(
                        groups,
                        job.roles,
                        job.engine,
                        step + 1,
                        cfg.weight_sync,
                        job.weight_buffers,
                    )
                )
            report.update(timer.metrics(prefix="timing"))
            if job.roles:
                job.log_step(step, report, batch_metrics, time.perf_counter() - start, gen_reports)
        job.write_trace()
    finally:
        job.close()
