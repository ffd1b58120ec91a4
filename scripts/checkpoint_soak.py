"""Soak of the asynchronous loop's checkpoints under kills: nothing lost, nothing done twice.

    .venv/bin/python scripts/checkpoint_soak.py [--steps 60] [--kills 5] [--every 5]
        [--modes wait in_flight] [--seed 0] [--out runs/checkpoint-soak]

Per weight-update mode, on the quick-start task (`scripts/quickstart.sh` writes it; this script
writes it too where missing) with `yaml_configs/tiny-grpo-async-cpu.yaml` (one step ahead):
1. a reference run of `--steps` steps, uninterrupted;
2. the same recipe under `MAX_RESTARTS=<kills>` (torchrun's `--max-restarts`) with `--kills`
   SIGKILLs of a random rank, alternating between the moment a checkpoint is being written (its
   partial directory exists) and a random moment (0-3 s after a step is logged: generation,
   weight sync or training); torchrun restarts the world each time and it resumes by itself;
3. with `--preempt`, then SIGTERM to the launcher (it must exit 83 after a save) and the same
   command again, which resumes and finishes.
Then it checks, and prints per mode: the launcher's exit codes, every step in `metrics.jsonl`
and `ledger.jsonl` exactly once; each step trained on exactly the prompts the reference
trained at that step (so no prompt is lost or repeated); every token within
`generate_ahead_steps` of its step; the resume records; and the mean reward of the last 10
steps against the reference's (sampling differs after a resume on CPU: README, Checkpoints).
Ends with a `RESULT` line. A script for the issue's note, not a test: about 5 minutes per
mode on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "yaml_configs" / "tiny-grpo-async-cpu.yaml"
PY = sys.executable


def _prepare() -> None:
    """The quick-start model and data (what scripts/quickstart.sh writes), where missing."""
    steps = [
        ("runs/tiny-llama/config.json", ["-m", "megatron_async_rl.models.tiny", "--family",
                                         "llama", "--out", "runs/tiny-llama", "--seed", "0"]),
        ("runs/arith/train.jsonl", ["-m", "megatron_async_rl.tasks.arithmetic", "--out",
                                    "runs/arith/train.jsonl", "--num-rows", "2000", "--seed", "0"]),
        ("runs/tiny-llama-warm/config.json", ["-m", "megatron_async_rl.tasks.warm_start",
                                              "--model", "runs/tiny-llama", "--data",
                                              "runs/arith/train.jsonl", "--out",
                                              "runs/tiny-llama-warm", "--seed", "0"]),
    ]  # fmt: skip
    for marker, args in steps:
        if not (REPO / marker).exists():
            subprocess.run([PY, *args], cwd=REPO, check=True)


def _launch(run_dir: Path, sets: list[str], port: int, log: Path,
            restarts: int = 0, nproc: int = 2) -> subprocess.Popen:  # fmt: skip
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(RECIPE), "--run-dir", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    env = dict(os.environ, PYTHON=PY, NPROC_PER_NODE=str(nproc), MASTER_PORT=str(port),
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               MAX_RESTARTS=str(restarts))  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "a"),
                            stderr=subprocess.STDOUT)  # fmt: skip


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _exists(listing) -> list[Path]:
    try:
        return listing()
    except FileNotFoundError:  # removed while listed
        return []


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone, or a zombie (a rank's finished writer)
        return ""


def _ranks(proc) -> list[psutil.Process]:
    """The ranks: the torchrun agent's own children (a rank's forked checkpoint writers share
    its command line)."""
    try:
        agents = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if "torch.distributed.run" in _cmdline(p)]  # fmt: skip
        return [p for a in agents for p in a.children()
                if "megatron_async_rl.train" in _cmdline(p)]  # fmt: skip
    except psutil.Error:  # the launcher or an agent ended meanwhile
        return []


def _wait(condition, proc, timeout=900) -> bool:
    """True once `condition()` holds; False if the run ended first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    raise TimeoutError("the run neither progressed nor ended")


def _fault(kind: str, proc, run_dir: Path, rng: random.Random) -> str:
    """Inflict one fault on the running `proc` once it logged a step more than when called
    (after a restart: a step after its resume); what was done (or why nothing was)."""
    metrics, ckpts = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    logged = len(_rows(metrics))
    if not _wait(lambda: len(_rows(metrics)) > logged, proc):
        return "the run ended before a new step"
    if kind == "sigterm":
        proc.send_signal(signal.SIGTERM)
        return "SIGTERM to the launcher"
    if kind == "save":  # a partial directory made after now (a killed save leaves its own)
        since = time.time()

        def writing() -> list[Path]:
            return [p for p in ckpts.glob(".partial_step_*") if p.stat().st_mtime > since]

        if not _wait(lambda: bool(_exists(writing)), proc):
            return "the run ended before a save"
        where = "while " + _exists(writing)[0].name + " was written"
    else:
        delay = rng.uniform(0.0, 3.0)
        time.sleep(delay)
        where = f"{delay:.1f} s after step {logged} was logged"
    ranks = _ranks(proc)
    if not ranks:
        return "no rank left to kill"
    victim = rng.choice(ranks)
    victim.send_signal(signal.SIGKILL)
    return f"SIGKILL of pid {victim.pid} {where}"


def soak(mode: str, args, out: Path) -> dict:
    sets = ["model.hf_path=runs/tiny-llama-warm", "data.path=runs/arith/train.jsonl",
            f"trainer.num_steps={args.steps}", f"checkpoint.every_steps={args.every}",
            "scheduler.validation_every=0", f"scheduler.weight_update_mode={mode}",
            f"seed={args.seed}"]  # fmt: skip
    ref_dir, run_dir = out / f"{mode}-reference", out / f"{mode}-faults"
    port = 29720 + (10 if mode == "in_flight" else 0)
    if not (ref_dir / "checkpoints" / f"step_{args.steps:08d}").exists():
        proc = _launch(ref_dir, sets, port, out / f"{mode}-reference.log")
        assert proc.wait() == 0, f"the reference run failed: {out / f'{mode}-reference.log'}"
    rng = random.Random(args.seed)
    faults, codes = [], []
    log = out / f"{mode}-faults.log"
    proc = _launch(run_dir, sets, port + 1, log, restarts=args.kills)
    for i in range(args.kills):
        what = _fault("save" if i % 2 == 0 else "random", proc, run_dir, rng)
        faults.append(what)
        print(f"[{mode}] fault {i + 1}/{args.kills}: {what}", flush=True)
    if args.preempt:
        what = _fault("sigterm", proc, run_dir, rng)
        codes.append(proc.wait())
        faults.append(what)
        print(f"[{mode}] {what}: launcher exit {codes[-1]}", flush=True)
        proc = _launch(run_dir, sets, port + 2, log)
    final = proc.wait()
    print(f"[{mode}] the run ended: launcher exit {final}", flush=True)
    return _check(mode, args, ref_dir, run_dir, faults, codes, final)


def exactly_once(ref_dir: Path, run_dir: Path, num_steps: int, ahead: int = 1) -> list[str]:
    """What is wrong with `run_dir` against the uninterrupted `ref_dir`: steps missing or
    logged twice, steps trained on other prompts, tokens more than `ahead` versions old."""
    ref_ledger = {r["step"]: r for r in _rows(ref_dir / "ledger.jsonl")}
    ledger, rows = _rows(run_dir / "ledger.jsonl"), _rows(run_dir / "metrics.jsonl")
    steps, problems = list(range(num_steps)), []
    if [r["step"] for r in rows] != steps:
        problems.append(f"metrics.jsonl steps {[r['step'] for r in rows]}")
    if [r["step"] for r in ledger] != steps:
        problems.append(f"ledger.jsonl steps {[r['step'] for r in ledger]}")
    differing = [r["step"] for r in ledger if r["prompts"] != ref_ledger[r["step"]]["prompts"]]
    if differing:
        problems.append(f"steps trained on other prompts than the reference's: {differing}")
    stale = [r["step"] for r in ledger if r["step"] - r["versions"][0] > ahead]
    if stale:
        problems.append(f"steps with a token older than {ahead} version(s): {stale}")
    return problems


def _check(mode, args, ref_dir, run_dir, faults, codes, final) -> dict:
    rows = _rows(run_dir / "metrics.jsonl")
    problems = [] if final == 0 else [f"the last resume exited {final}"]
    problems += exactly_once(ref_dir, run_dir, args.steps)
    if codes and codes != [83]:
        problems.append(f"the preempted launcher exited {codes[0]}, not 83")
    resumes = [r for r in rows if "resume/from_step" in r]
    restored = sum(r.get("resume/samples_restored", 0) for r in resumes)
    partial = sum(r.get("resume/partial_tokens_restored", 0) for r in resumes)
    last = lambda rs: sum(r["reward/mean"] for r in rs[-10:]) / len(rs[-10:])  # noqa: E731
    ref_rows = _rows(ref_dir / "metrics.jsonl")
    summary = {
        "mode": mode, "faults": len(faults), "resumes": len(resumes),
        "resumed_from": [int(r["resume/from_step"]) for r in resumes],
        "samples_restored": restored, "partial_tokens_restored": partial,
        "reward_last10": round(last(rows), 4),
        "reference_reward_last10": round(last(ref_rows), 4), "problems": problems,
    }  # fmt: skip
    print(json.dumps(summary), flush=True)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every_steps")
    parser.add_argument("--modes", nargs="+", default=["wait", "in_flight"],
                        choices=["wait", "in_flight"])  # fmt: skip
    parser.add_argument("--preempt", action="store_true",
                        help="end with a SIGTERM preemption and a resume")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/checkpoint-soak")
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:  # a fresh faulted run each time: its old results are removed
        subprocess.run(["rm", "-rf", str(out / f"{mode}-faults")], check=True)
    _prepare()
    results = [soak(mode, args, out) for mode in args.modes]
    ok = all(not r["problems"] for r in results)
    print(f"RESULT checkpoint_soak={'pass' if ok else 'fail'} "
          + " ".join(f"{r['mode']}:faults={r['faults']},resumes={r['resumes']}"
                     for r in results))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
