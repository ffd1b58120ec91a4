"""Compare a run's logged `actor/lr` and `actor/wd` with megatron-core's scheduler driven alone.

    python scripts/lr_schedule_check.py runs/mb-sched [--png docs/figures/lr_schedule.png]

Reads the run's `config.resolved.yaml` (recipe + flags, as the run resolved them), builds
megatron-core's `OptimizerParamScheduler` with the same arguments over a plain torch optimizer
(`roles.lr_schedule.schedule_kwargs`), steps it once per optimizer step, and prints the largest
difference from the values the run logged (the last optimizer step of each RL step, as logged).
Prints `RESULT lr_max_abs_diff=... wd_max_abs_diff=... steps=N`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("run_dir", type=Path)
    cli.add_argument("--png", type=Path)
    args = cli.parse_args()

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_async_rl.algorithms.minibatch import run_optimizer_steps_per_rl_step
    from megatron_async_rl.recipe.load import resolve
    from megatron_async_rl.roles.lr_schedule import schedule_kwargs

    cfg = resolve(args.run_dir / "config.resolved.yaml", [], [], check_paths=False)
    ramp = {k: cfg.role_megatron_args["train"].get(k)
            for k in ("rampup_batch_size", "decrease_batch_size_if_needed")}  # fmt: skip
    if any(ramp.values()):
        raise SystemExit(
            f"{args.run_dir}: {ramp}: this check replays a fixed --global-batch-size (one "
            "scheduler step per optimizer step); a ramped schedule (G_k / G per step) is checked "
            "against megatron-core's in tests/unit/test_batch_ramp.py"
        )
    per_step = run_optimizer_steps_per_rl_step(cfg)
    train_args = cfg.role_megatron_args["train"]
    kwargs = schedule_kwargs(train_args, cfg.trainer.num_steps * per_step)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(optimizer, **kwargs)
    alone_lr, alone_wd = [], []
    for _ in range(cfg.trainer.num_steps):
        for _ in range(per_step):
            lr, wd = optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["weight_decay"]
            scheduler.step(increment=1)
        alone_lr.append(lr)  # the last optimizer step of the RL step, as the run logs it
        alone_wd.append(wd)
    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged_lr = [row["actor/lr"] for row in rows]
    logged_wd = [row["actor/wd"] for row in rows]
    n = min(len(logged_lr), len(alone_lr))
    lr_diff = max(abs(a - b) for a, b in zip(logged_lr[:n], alone_lr[:n]))
    wd_diff = max(abs(a - b) for a, b in zip(logged_wd[:n], alone_wd[:n]))
    print(f"first lrs logged {logged_lr[:6]}; alone {alone_lr[:6]}")
    print(f"RESULT lr_max_abs_diff={lr_diff:.3g} wd_max_abs_diff={wd_diff:.3g} steps={n}")
    if args.png:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 3.5), dpi=110, layout="constrained")
        ax = fig.subplots()
        ax.plot(range(1, n + 1), logged_lr[:n], lw=3, alpha=0.5, label="actor/lr logged by the run")
        ax.plot(range(1, n + 1), alone_lr[:n], "k--", lw=1, label="OptimizerParamScheduler alone")
        ax.set_xlabel("RL step")
        ax.set_ylabel("learning rate")
        ax.set_title(f"{args.run_dir.name}: {train_args['lr_decay_style']} decay, warm-up "
                     f"{train_args['lr_warmup_iters']} iters")  # fmt: skip
        ax.legend()
        fig.savefig(args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
