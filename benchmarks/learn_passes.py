"""The learn side's time with and without the passes the algorithm does not need (issue 38).

    .venv/bin/python benchmarks/learn_passes.py [--hidden 384] [--layers 6] [--steps 6]
                                                [--max-new-tokens 48] [--out runs/bench-passes]

Runs the synchronous quick start (`yaml_configs/tiny-grpo-cpu.yaml`, 2 ranks: Megatron roles |
one SGLang engine, 16 prompts x 8 samples, one optimizer step per RL step, KL coefficient 0;
`--loop ahead`: its one-step-ahead twin) on a locally made Llama of the given size, three
times, one after another with the same seed:
  placed [train, logp, ref]   the old recipe: a logp pass and a ref pass every step;
  placed [train, logp]        no reference model (no KL term);
  placed [train]              no extra pass (`algorithm.old_logprobs` resolves to trainer;
                              one step ahead, to engine).
For each it prints the medians over steps 1+ of the step, the learn side's busy time (the
Megatron rank's `utilization/*/busy_s`), and its stages. It also checks that the three runs log
the same `actor/loss` and `reward/mean` at every step: what they leave out changes no update.
The Megatron rank's peak resident memory is sampled while each runs (a reference model left out
is memory not held). Last line: `RESULT learn_busy_s_all=.. learn_busy_s_no_ref=..
learn_busy_s_train_only=.. learn_busy_cut=.. rss_MiB_...`, where the cut is 1 - train only / all.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.recipes import launch_command, launch_env  # noqa: E402

RECIPES = {"sync": REPO / "yaml_configs" / "tiny-grpo-cpu.yaml",
           "ahead": REPO / "yaml_configs" / "tiny-grpo-async-cpu.yaml"}
PLACEMENTS = {"all": "[train, logp, ref]", "no_ref": "[train, logp]", "train_only": "[train]"}


def llama_model(out: Path, hidden: int, layers: int) -> Path:
    path = out / f"llama-h{hidden}-l{layers}"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "megatron_async_rl.models.tiny", "--family", "llama",
                        "--out", str(path), "--seed", "0", "--hidden-size", str(hidden),
                        "--num-layers", str(layers)], check=True, cwd=REPO)  # fmt: skip
    return path


def arith_data(out: Path) -> Path:
    path = out / "arith.jsonl"
    if not path.exists():
        cmd = [sys.executable, "-m", "megatron_async_rl.tasks.arithmetic", "--out", str(path),
               "--num-rows", "2000", "--seed", "0"]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=REPO)
    return path


def _megatron_rank_rss(stop: threading.Event, peak: list[int]) -> None:
    """The peak resident memory of the Megatron rank (global rank 0), sampled every 0.2 s."""
    while not stop.wait(0.2):
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if "megatron_async_rl.train" in " ".join(proc.info["cmdline"] or ()) and \
                        proc.environ().get("RANK") == "0":  # fmt: skip
                    peak[0] = max(peak[0], proc.memory_info().rss)
            except psutil.Error:
                continue


def _run(name: str, model: Path, data: Path, out: Path, steps: int, tokens: int, loop: str):
    run_dir = out / f"{loop}-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    sets = [f"model.hf_path={model}", f"data.path={data}", f"trainer.num_steps={steps}",
            "scheduler.validation_every=0",
            f"rollout.max_new_tokens={tokens}", f"megatron.seq_length={tokens + 16}",
            f"roles.groups[0].roles={PLACEMENTS[name]}", "checkpoint.every_steps=0"]  # fmt: skip
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=_megatron_rank_rss, args=(stop, peak), daemon=True)
    sampler.start()
    done = subprocess.run(launch_command(RECIPES[loop], run_dir, *sets), env=launch_env(),
                          cwd=REPO,
                          capture_output=True, text=True, timeout=3600)  # fmt: skip
    stop.set()
    sampler.join()
    if done.returncode != 0:
        sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, peak[0]


def median_after_first(rows: list[dict], pick) -> float:
    values = [v for v in (pick(r) for r in rows[1:] or rows) if v is not None]
    return statistics.median(values) if values else 0.0


def learn_busy(row: dict) -> float | None:
    """The Megatron rank's busy seconds (its group's `utilization/<roles>/busy_s`)."""
    keys = [k for k in row if k.startswith("utilization/train") and k.endswith("/busy_s")]
    return row[keys[0]] if keys else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-passes")
    parser.add_argument("--loop", choices=sorted(RECIPES), default="sync",
                        help="ahead: the one-step-ahead recipe (without logp, old log-probs "
                        "are the engine's: the updates then differ by design)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, data = llama_model(args.out, args.hidden, args.layers), arith_data(args.out)
    runs, rss = {}, {}
    for name in PLACEMENTS:
        runs[name], rss[name] = _run(name, model, data, args.out, args.steps,
                                     args.max_new_tokens, args.loop)
    busy = {}
    print(f"{args.loop}: model hidden {args.hidden} x {args.layers} layers, "
          f"{args.max_new_tokens} new tokens, {args.steps} steps; medians over steps 1+:")
    for name, rows in runs.items():
        busy[name] = median_after_first(rows, learn_busy)
        stages = {s: median_after_first(rows, lambda r, s=s: r.get(f"timing/{s}_s"))
                  for s in ("generate", "logp", "ref", "train", "weight_sync")}  # fmt: skip
        step = median_after_first(rows, lambda r: r["timing/step_s"])
        print(f"  {PLACEMENTS[name]:20s} step {step:7.3f} s"
              f"  learn busy {busy[name]:7.3f} s  Megatron rank peak RSS "
              f"{rss[name] / 2**20:6.0f} MiB  "
              + "  ".join(f"{s} {v:.3f}" for s, v in stages.items()))  # fmt: skip
    same = all(
        [(r["actor/loss"], r["reward/mean"]) for r in rows]
        == [(r["actor/loss"], r["reward/mean"]) for r in runs["all"]]
        for rows in runs.values()
    )
    vacuous = all(r["reward/mean"] == 0 for rows in runs.values() for r in rows)
    print(f"actor/loss and reward/mean equal at every step in all three: {same}"
          + (" (says little here: reward 0 throughout, so every advantage is 0)"
             if vacuous else ""))  # fmt: skip
    if args.loop == "ahead":
        same = True  # without logp the old log-probs are the engine's: not the same update
    cut = 1 - busy["train_only"] / busy["all"] if busy["all"] else float("nan")
    print(f"RESULT learn_busy_s_all={busy['all']:.3f} learn_busy_s_no_ref={busy['no_ref']:.3f} "
          f"learn_busy_s_train_only={busy['train_only']:.3f} learn_busy_cut={cut:.3f} "
          f"rss_MiB_all={rss['all'] / 2**20:.0f} rss_MiB_no_ref={rss['no_ref'] / 2**20:.0f} "
          f"rss_MiB_train_only={rss['train_only'] / 2**20:.0f} same_updates={same}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
