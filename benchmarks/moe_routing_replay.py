"""Routing replay side by side: what the engine/trainer mismatch metrics show with R3 off and on.

    python benchmarks/moe_routing_replay.py [--steps 4] [--noise 1.0] [--layouts one,ep2-pp2]

Runs `yaml_configs/tiny-moe-r3-cpu.yaml` (tiny Qwen3-MoE, engine bfloat16, trainer float32)
synchronously (N=0, so the engine and the logp role hold the same weights and every mismatch
is numerics or routing) for each layout and each mismatch source, with `moe.routing_replay`
off and r3, and prints one row per run: the share of tokens whose trainer top-k equals the
engine's (the router's own choice: `moe/routing_agreement`; the experts used:
`moe/replay_agreement`) and the log-prob mismatch of the logp pass against the engine
(`mismatch/k3_kl`, `mismatch/max_abs`, `logprob/engine_vs_train_abs_diff`), and the train
pass's largest ratio pi / pi_old (`actor/ratio_max`: 1 where train and logp route alike, as
the recipe takes one optimizer step per RL step), means over the steps. Mismatch sources: the
bf16 engine alone, and `faults.router_noise` (the trainer's routers choose on noisy scores, an
induced mismatch). Layouts: `one` (train, logp and ref on
one rank) and `ep2-pp2` (train EP=2 on 2 ranks, logp+ref PP=2 on 2 ranks). Each run starts an
engine (about 30 s) and writes under runs/bench-routing/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "yaml_configs" / "tiny-moe-r3-cpu.yaml"
KEYS = ("moe/routing_agreement", "moe/replay_agreement", "mismatch/k3_kl", "mismatch/max_abs",
        "logprob/engine_vs_train_abs_diff", "actor/ratio_max", "timing/logp_s",
        "timing/train_s")  # fmt: skip
LAYOUTS = {
    "one": ("roles.groups=[{roles: [train, logp, ref], num_ranks: 1}, "
            "{roles: [generate], num_ranks: 1}]",),
    "ep2-pp2": (
        "roles.groups=[{roles: [train], num_ranks: 2}, {roles: [logp, ref], num_ranks: 2}, "
        "{roles: [generate], num_ranks: 1}]",
        "roles.train.megatron={expert_model_parallel_size: 2}",
        "roles.logp.megatron={pipeline_model_parallel_size: 2}",
        "roles.ref.megatron={pipeline_model_parallel_size: 2}",
    ),
}
NPROC = {"one": 2, "ep2-pp2": 5}


def prepare(model: Path) -> None:
    """The tiny MoE and its warm start, as `scripts/moe_quickstart.sh` writes them."""
    py = sys.executable
    if not (REPO / "runs/arith/train.jsonl").exists():
        subprocess.run([py, "-m", "megatron_async_rl.tasks.arithmetic", "--out",
                        "runs/arith/train.jsonl", "--num-rows", "2000", "--seed", "0"],
                       cwd=REPO, check=True)  # fmt: skip
    if not (REPO / "runs/tiny-qwen3-moe/config.json").exists():
        subprocess.run([py, "-m", "megatron_async_rl.models.tiny", "--family", "qwen3_moe",
                        "--out", "runs/tiny-qwen3-moe", "--seed", "0"], cwd=REPO, check=True)
    if not (model / "config.json").exists():
        subprocess.run([py, "-m", "megatron_async_rl.tasks.warm_start", "--model",
                        "runs/tiny-qwen3-moe", "--data", "runs/arith/train.jsonl", "--out",
                        str(model), "--seed", "0"], cwd=REPO, check=True)  # fmt: skip


def run(name: str, layout: str, sets: list[str], steps: int, port: int) -> dict[str, float]:
    run_dir = REPO / "runs" / "bench-routing" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(RECIPE), "--run-dir", str(run_dir)]
    for item in (f"trainer.num_steps={steps}", "scheduler.generate_ahead_steps=0",
                 *LAYOUTS[layout], *sets):  # fmt: skip
        cmd += ["--set", item]
    env = dict(os.environ, PYTHON=sys.executable, NPROC_PER_NODE=str(NPROC[layout]),
               MASTER_PORT=str(port))  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {k: sum(r.get(k, float("nan")) for r in rows) / len(rows) for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--noise", type=float, default=1.0, help="faults.router_noise")
    parser.add_argument("--layouts", default="one,ep2-pp2")
    parser.add_argument("--port", type=int, default=29931)
    args = parser.parse_args()
    prepare(REPO / "runs" / "tiny-qwen3-moe-warm")
    sources = {"bf16 engine": [], f"+ router noise {args.noise}": [
        "faults.allow=true", f"faults.router_noise={args.noise}"]}
    header = ("layout", "mismatch", "R3", *(k.split("/", 1)[1] for k in KEYS))
    print(" | ".join(header))
    for layout in args.layouts.split(","):
        for source, sets in sources.items():
            for mode in ("off", "r3"):
                name = f"{layout}-{'noise' if sets else 'bf16'}-{mode}"
                got = run(name, layout, [*sets, f"moe.routing_replay={mode}"], args.steps,
                          args.port)  # fmt: skip
                cells = [f"{got[k]:.4g}" for k in KEYS]
                print(" | ".join((layout, source, mode, *cells)), flush=True)


if __name__ == "__main__":
    main()
