"""PPO with a critic learning the CPU arithmetic task, synchronous and one step ahead, and a
five-window run with a reward model for the stage timeline.

    python benchmarks/ppo_learning.py [--steps 60] [--five-steps 6]

Runs `yaml_configs/tiny-ppo-cpu.yaml` (after `bash scripts/quickstart.sh` wrote
runs/tiny-llama-warm and runs/arith) synchronously and with `generate_ahead_steps: 1`, then on
five one-rank windows (train | logp+ref | critic | reward_model | generate) with a reward model
(`runs/tiny-rm`, a one-label sequence classifier written here with the policy's tokenizer if
absent) one step ahead. Prints per run the wall time, the mean reward of the first and last 10
steps, the first step whose 5-step mean reward is 0.3 above the first 5 steps' (and the
seconds of steps to it), the critic's explained variance of the first and last 10 steps and the
largest policy lag; for the five-window run each group's busy seconds per step and the seconds
`critic_train` overlapped the actor's `train`. Draws docs/figures/ppo_learning.png (reward),
docs/figures/ppo_explained_var.png and docs/figures/ppo_five_windows_timeline.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_async_rl.observability.plots import (  # noqa: E402
    plot_reward_curve,
    plot_stage_timeline,
)

RECIPE = REPO / "yaml_configs" / "tiny-ppo-cpu.yaml"
FIVE_WINDOWS = ("roles.groups=[{roles: [train], num_ranks: 1}, {roles: [logp, ref], num_ranks: 1}, "
                "{roles: [critic], num_ranks: 1}, {roles: [reward_model], num_ranks: 1}, "
                "{roles: [generate], num_ranks: 1}]")  # fmt: skip
GROUPS = ("train", "logp+ref", "critic", "reward_model", "generate")
HOLDERS = {"logp": (1,), "ref": (1,), "critic_values": (2,), "critic_train": (2,),
           "reward_model": (3,), "train": (0,), "weight_sync": (0,)}  # fmt: skip
STAGES = ("dataloader", "generate", "reward", "load_weights", "logp", "ref", "reward_model",
          "critic_values", "train", "critic_train", "weight_sync")
"""The five-window ranks whose spans of a stage are drawn: those holding its role (every
Megatron rank records every learn stage; on the others it is the batch's layout, the train
stage's gather and GAE, or nothing)."""


def run(name: str, sets: list[str], port: int, nproc: int = 2) -> tuple[Path, float]:
    run_dir = REPO / "runs" / "bench-ppo" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(RECIPE), "--run-dir", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE=str(nproc),
               MASTER_PORT=str(port))  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return run_dir, time.perf_counter() - start


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path, wall_s: float) -> str:
    rows = _rows(run_dir)
    reward = [r["reward/mean"] for r in rows]
    first = sum(reward[:5]) / 5
    window = [sum(reward[i - 4 : i + 1]) / 5 for i in range(4, len(reward))]
    reached = next((i + 4 for i, v in enumerate(window) if v >= first + 0.3), None)
    elapsed = sum(r["timing/step_s"] for r in rows[: reached + 1]) if reached is not None else None
    ev = [r["critic/explained_var"] for r in rows]
    n = min(10, len(rows))
    return (
        f"wall {wall_s:.0f} s; reward first{n} {sum(reward[:n]) / n:.3f} last{n} "
        f"{sum(reward[-n:]) / n:.3f}; +0.3 at step {reached} ({elapsed and round(elapsed)} s of "
        f"steps); explained_var first{n} {sum(ev[:n]) / n:.2f} last{n} {sum(ev[-n:]) / n:.2f}; "
        f"policy_lag/max {max(r['policy_lag/max'] for r in rows):.0f}"
    )


def overlap_s(run_dir: Path, stage: str, rank: int, other: str, other_rank: int) -> float:
    """Seconds `stage` on `rank` overlapped `other` on `other_rank` at the same step."""
    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]

    def of(name, pid):
        return {e["args"].get("step"): (e["ts"], e["ts"] + e["dur"]) for e in spans
                if e["name"] == name and e["pid"] == pid}  # fmt: skip

    mine, theirs = of(stage, rank), of(other, other_rank)
    return sum(max(0.0, min(a[1], theirs[s][1]) - max(a[0], theirs[s][0])) / 1e6
               for s, a in mine.items() if s in theirs)  # fmt: skip


def plot_timeline(run_dir: Path, out_png: Path) -> None:
    """The five-window run's stages, each on the ranks holding its role, in pipeline order
    (the final checkpoint's save, seconds long, is left out)."""
    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [{"stage": e["name"], "rank": e["pid"], "start_s": e["ts"] / 1e6,
              "end_s": (e["ts"] + e["dur"]) / 1e6}
             for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] in STAGES
             and e["pid"] in HOLDERS.get(e["name"], (e["pid"],))]  # fmt: skip
    plot_stage_timeline(spans, out_png, stages=STAGES,
                        title="PPO on five windows, one step ahead")  # fmt: skip


def reward_model(path: Path) -> Path:
    if not (path / "config.json").is_file():
        from megatron_async_rl.models.tiny import write_tiny_model

        write_tiny_model(path, "llama", seed=1, task="sequence_classification")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--five-steps", type=int, default=6)
    parser.add_argument("--port", type=int, default=29951)
    args = parser.parse_args()
    steps = f"trainer.num_steps={args.steps}"
    runs = {"synchronous": [steps], "one step ahead": [steps, "scheduler.generate_ahead_steps=1"]}
    dirs = {}
    for i, (label, sets) in enumerate(runs.items()):
        dirs[label], wall = run(label.replace(" ", "-"), sets, args.port + i)
        print(f"{label}: {summary(dirs[label], wall)}", flush=True)
    rm = reward_model(REPO / "runs" / "tiny-rm")
    sets = [f"trainer.num_steps={args.five_steps}", FIVE_WINDOWS, f"reward_model.hf_path={rm}",
            "reward_model.weight=0.5", "scheduler.generate_ahead_steps=1"]
    five, wall = run("five", sets, args.port + 2, nproc=5)
    rows = _rows(five)
    busy = {g: sum(r[f"utilization/{g}/busy_s"] for r in rows) / len(rows) for g in GROUPS}
    print(f"five windows: wall {wall:.0f} s; busy s/step " + ", ".join(
        f"{g} {v:.3f}" for g, v in busy.items()) + f"; critic_train overlapped train "
        f"{overlap_s(five, 'critic_train', 2, 'train', 0):.3f} s in {len(rows)} steps")  # fmt: skip
    figures = REPO / "docs" / "figures"
    labels = list(dirs)
    extra = {label: dirs[label] / "metrics.jsonl" for label in labels[1:]}
    plot_reward_curve(dirs[labels[0]] / "metrics.jsonl", figures / "ppo_learning.png",
                      run_label=labels[0], extra_runs=extra, std_band=False, moving_average=5,
                      title="tiny Llama, PPO with a critic: reward")  # fmt: skip
    plot_reward_curve(dirs[labels[0]] / "metrics.jsonl", figures / "ppo_explained_var.png",
                      keys=("critic/explained_var",), run_label=labels[0], extra_runs=extra,
                      std_band=False, moving_average=5,
                      title="the critic's explained variance")  # fmt: skip
    plot_timeline(five, figures / "ppo_five_windows_timeline.png")
    print(f"figures: {figures / 'ppo_learning.png'}, {figures / 'ppo_explained_var.png'}, "
          f"{figures / 'ppo_five_windows_timeline.png'}")


if __name__ == "__main__":
    main()
