"""Synchronous vs asynchronous GRPO step time, side by side in one run, on the tiny CPU setup.

    .venv/bin/python benchmarks/pipeline_overlap.py [--steps 13] [--warmup 3] [--ahead 1]
        [--hidden-size 384 --num-layers 6] [--in-flight] [--max-new-tokens 4]

Runs `yaml_configs/tiny-grpo-cpu.yaml` twice through `launch/torchrun.sh` (one Megatron rank,
one generate rank): the synchronous loop, then the asynchronous loop with
`generate_ahead_steps = N`, on a tiny model and task it writes itself. For the measured steps
(after warm-up) it prints each stage's seconds, the sync step, the async step, the ideal bound
(the larger per-rank-group busy time per step in the async run, from its trace.json) and
eta = ideal / async step. Last line: `RESULT eta=<float> speedup=<float>` with
speedup = sync step / async step. With `--in-flight` a third run uses
`weight_update_mode: in_flight` (the others `wait`), and the last line adds
`in_flight_vs_wait=<in-flight step / wait step>` (at most 1: in-flight is not slower).
A benchmark, not a test: both runs share this machine's
noise, so read the ratios, not the absolute seconds.

The default model (hidden 384, 6 layers; still tiny) makes the generate rank and the Megatron
rank about equally busy, the case the overlap exists for (the speedup target assumes their busy
times within 2x; the script prints the ratio). With the quick-start model (hidden 64, 2
layers) the engine is 3x busier than training and bounds both loops alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = (
    "dataloader", "generate", "reward", "logp", "ref", "train", "weight_sync",
    "weight_sync/receive", "load_weights",
)  # fmt: skip
PAUSED = " (paused)"
"""Trace spans of a stage paused by an in-flight weight load: a wait, not work."""


def _run(root: Path, name: str, steps: int, port: int, *sets: str) -> Path:
    run_dir = root / name
    cmd = [
        "bash", str(REPO / "launch" / "torchrun.sh"), str(REPO / "yaml_configs/tiny-grpo-cpu.yaml"),
        "--run-dir", str(run_dir), "--set", f"model.hf_path={root / 'model'}",
        "--set", f"data.path={root / 'train.jsonl'}", "--set", f"trainer.num_steps={steps}",
    ]  # fmt: skip
    for item in sets:
        cmd += ["--set", item]
    env = dict(os.environ, NPROC_PER_NODE="2", MASTER_PORT=str(port), PYTHON=sys.executable)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{name} run failed with exit code {proc.returncode}")
    return run_dir


def _steps(run_dir: Path, warmup: int) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[warmup:]


def _mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / len(rows)


def _step_of(event: dict) -> int:
    """The step a span belongs to (a weight load of version v: step v - 1, which produced it;
    validation: none)."""
    step = event["args"].get("step")
    return -1 if step is None else step


def _ideal_step_s(run_dir: Path, warmup: int, steps: int) -> tuple[float, dict]:
    """Busy seconds per step of each rank group over the measured steps of the async run."""
    from megatron_async_rl.observability.utilization import busy_idle, ideal_step_s

    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    spans, roles_of_rank = [], {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            label = e["args"]["name"]  # "rank 0 (train+logp+ref)"
            roles_of_rank[e["pid"]] = tuple(label.split("(")[1].rstrip(")").split("+"))
        elif e["ph"] == "X" and _step_of(e) >= warmup and not e["name"].endswith(PAUSED):
            start = e["ts"] / 1e6
            spans.append({"stage": e["name"], "rank": e["pid"], "start_s": start,
                          "end_s": start + e["dur"] / 1e6})  # fmt: skip
    window = (min(s["start_s"] for s in spans), max(s["end_s"] for s in spans))
    usage = busy_idle(spans, window[0], window[1], roles_of_rank)
    per_group = {k: v / (steps - warmup) for k, v in usage.items() if k.endswith("/busy_s")}
    return ideal_step_s(per_group), per_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--ahead", type=int, default=1, help="generate_ahead_steps of the async run"
    )
    parser.add_argument(
        "--hidden-size", type=int, default=384, help="tiny model width (training cost grows "
        "with it much faster than SGLang's per-token overhead on CPU)",
    )  # fmt: skip
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument(
        "--in-flight", action="store_true",
        help="also run the async loop with weight_update_mode=in_flight and compare with wait",
    )  # fmt: skip
    parser.add_argument(
        "--max-new-tokens", type=int, default=4,
        help="rollout.max_new_tokens of every run (longer answers give in-flight loads "
        "something to interrupt)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.steps - args.warmup < 5:
        raise SystemExit("--steps - --warmup must leave at least 5 measured steps")
    sys.path.insert(0, str(REPO))
    from megatron_async_rl.models.tiny import write_tiny_model
    from megatron_async_rl.tasks.arithmetic import write_arithmetic_dataset

    root = Path(tempfile.mkdtemp(prefix="pipeline_overlap_"))
    write_tiny_model(root / "model", "llama", seed=0, hidden_size=args.hidden_size,
                     num_hidden_layers=args.num_layers)  # fmt: skip
    write_arithmetic_dataset(root / "train.jsonl", num_rows=500, seed=0)
    tokens = f"rollout.max_new_tokens={args.max_new_tokens}"
    ahead = f"scheduler.generate_ahead_steps={args.ahead}"
    sync_dir = _run(root, "sync", args.steps, 29701, tokens)
    async_dir = _run(root, "async", args.steps, 29702, tokens, ahead)
    runs = {"sync": _steps(sync_dir, args.warmup), "async": _steps(async_dir, args.warmup)}
    if args.in_flight:
        in_flight = "scheduler.weight_update_mode=in_flight"
        runs["in_flight"] = _steps(_run(root, "in_flight", args.steps, 29703, tokens, ahead,
                                        in_flight), args.warmup)  # fmt: skip
    sync_rows, async_rows = runs["sync"], runs["async"]

    print(f"{'stage (mean s per step)':<26}" + "".join(f"{name:>10}" for name in runs))
    for stage in (*STAGES, "step"):
        key = f"timing/{stage}_s"
        print(f"{stage:<26}" + "".join(f"{_mean(rows, key):>10.3f}" for rows in runs.values()))
    sync_step, async_step = _mean(sync_rows, "timing/step_s"), _mean(async_rows, "timing/step_s")
    ideal, per_group = _ideal_step_s(async_dir, args.warmup, args.steps)
    for group, busy in sorted(per_group.items()):
        print(f"busy per step {group:<40}{busy:>8.3f}")
    ratio = max(per_group.values()) / max(min(per_group.values()), 1e-9)
    print(f"busiest / least busy group: {ratio:.2f} (the speedup target of 1.4 assumes <= 2)")
    print(
        f"sync step {sync_step:.3f} s   async step {async_step:.3f} s   ideal bound {ideal:.3f} s"
    )
    for name, rows in runs.items():
        lag, stall = _mean(rows, "policy_lag/mean"), _mean(rows, "weight_sync/stall_s")
        lag_max = max(r["policy_lag/max"] for r in rows)
        print(f"{name}: policy_lag/max {lag_max:.0f}, mean {lag:.2f}; stall {stall:.3f} s")
    print(f"runs in {root}")
    result = f"RESULT eta={ideal / async_step:.3f} speedup={sync_step / async_step:.3f}"
    if args.in_flight:
        result += f" in_flight_vs_wait={_mean(runs['in_flight'], 'timing/step_s') / async_step:.3f}"
    print(result)


if __name__ == "__main__":
    main()
