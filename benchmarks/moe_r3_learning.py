"""The asynchronous MoE recipe learning with routing replay, and without it under a mismatch.

    python benchmarks/moe_r3_learning.py [--steps 60] [--noise 1.0]

Runs `yaml_configs/tiny-moe-r3-cpu.yaml` (async, N=1, engine bf16, trainer fp32, token TIS)
three times: as written (R3 on), with R3 on under an induced routing mismatch
(`faults.router_noise`: the trainer's routers choose on noisy scores), and with R3 off under
the same mismatch. Prints per run the wall time, the mean reward of the first and last 5 steps,
the first step whose 5-step mean reward is 0.3 above the first 5 steps' (and its time), and the
mean mismatch metrics; draws docs/figures/moe_r3_learning.png (reward) and
docs/figures/moe_r3_mismatch.png (engine-vs-trainer |log-prob| gap) side by side.
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
sys.path.insert(0, str(REPO / "benchmarks"))

from moe_routing_replay import RECIPE, prepare  # noqa: E402

from megatron_async_rl.observability.plots import plot_reward_curve  # noqa: E402


def run(name: str, sets: list[str], steps: int, port: int) -> tuple[Path, float]:
    run_dir = REPO / "runs" / "bench-r3-learning" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(RECIPE), "--run-dir", str(run_dir),
           "--set", f"trainer.num_steps={steps}"]  # fmt: skip
    for item in sets:
        cmd += ["--set", item]
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE="2", MASTER_PORT=str(port))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return run_dir / "metrics.jsonl", time.perf_counter() - start


def summary(path: Path, wall_s: float) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    reward = [r["reward/mean"] for r in rows]
    first = sum(reward[:5]) / 5
    window = [sum(reward[i - 4 : i + 1]) / 5 for i in range(4, len(reward))]
    reached = next((i + 4 for i, v in enumerate(window) if v >= first + 0.3), None)
    elapsed = sum(r["timing/step_s"] for r in rows[: reached + 1]) if reached is not None else None

    def mean(key):
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    return (
        f"wall {wall_s:.0f} s; reward first5 {first:.3f} last5 {sum(reward[-5:]) / 5:.3f}; "
        f"+0.3 at step {reached} ({elapsed and round(elapsed)} s of steps); "
        f"routing_agreement {mean('moe/routing_agreement'):.3f} replay_agreement "
        f"{mean('moe/replay_agreement'):.3f} k3_kl {mean('mismatch/k3_kl'):.2e} "
        f"abs_diff {mean('logprob/engine_vs_train_abs_diff'):.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--noise", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=29941)
    args = parser.parse_args()
    prepare(REPO / "runs" / "tiny-qwen3-moe-warm")
    noise = ["faults.allow=true", f"faults.router_noise={args.noise}"]
    runs = {
        "r3": [],
        f"r3, router noise {args.noise}": noise,
        f"off, router noise {args.noise}": [*noise, "moe.routing_replay=off"],
    }
    paths = {}
    for label, sets in runs.items():
        name = label.replace(", ", "-").replace(" ", "-")
        paths[label], wall = run(name, sets, args.steps, args.port)
        print(f"{label}: {summary(paths[label], wall)}", flush=True)
    labels = list(paths)
    figures = REPO / "docs" / "figures"
    extra = {label: paths[label] for label in labels[1:]}
    plot_reward_curve(paths[labels[0]], figures / "moe_r3_learning.png", run_label=labels[0],
                      extra_runs=extra, title="tiny Qwen3-MoE, async GRPO: reward",
                      std_band=False, moving_average=5)  # fmt: skip
    plot_reward_curve(paths[labels[0]], figures / "moe_r3_mismatch.png",
                      keys=("logprob/engine_vs_train_abs_diff",), run_label=labels[0],
                      extra_runs=extra, title="engine vs trainer |log-prob| gap (logp pass)",
                      std_band=False)  # fmt: skip
    print(f"figures: {figures / 'moe_r3_learning.png'}, {figures / 'moe_r3_mismatch.png'}")


if __name__ == "__main__":
    main()
