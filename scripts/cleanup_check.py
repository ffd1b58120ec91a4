"""Nothing is left behind after any end: a normal run, and `kill -9` of the torchrun agent, of a
rank, or of an engine's scheduler.

    .venv/bin/python scripts/cleanup_check.py [--targets normal agent rank engine]
        [--out runs/cleanup-check] [--grace-s 45]

For each target, on the quick-start task (written where missing) with
`yaml_configs/tiny-grpo-async-cpu.yaml` on 2 ranks (train+logp | one SGLang engine),
`engine.max_restarts=0` (a dead engine ends the run: nothing restarts what was killed):
1. note the processes of ours or SGLang's and the `/dev/shm` entries that exist;
2. launch, and once a step is logged, SIGKILL the target: the torchrun agent (the launcher's
   `torch.distributed.run` child), a random rank (one of the agent's children) or the engine's
   scheduler process; `normal` kills nothing and lets the run of 6 steps end;
3. wait for the launcher to end (the launcher itself is killed `--grace-s` after an agent kill,
   as a shell or SLURM would end the job), then up to `--grace-s` for what remains to go.
It prints per target what was killed, how long the last process of ours took to go, and the
processes and `/dev/shm` entries left (both must be none), and ends with a `RESULT` line.
A check for the issue's note, not a test: about 1.5 minutes per target on 2 CPU cores.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_soak import REPO, _cmdline, _launch, _prepare, _ranks, _rows  # noqa: E402
from engine_fault_soak import _ours  # noqa: E402


def _agent(proc) -> psutil.Process | None:
    try:
        return next((p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "torch.distributed.run" in _cmdline(p)), None)  # fmt: skip
    except psutil.Error:
        return None


def _scheduler(proc) -> psutil.Process | None:
    try:
        return next((p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "scheduler" in p.name()), None)  # fmt: skip
    except psutil.Error:
        return None


def _check(target: str, out: Path, grace_s: float, port: int, rng: random.Random) -> dict:
    run_dir, log = out / target, out / f"{target}.log"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    log.unlink(missing_ok=True)
    shm_before, procs_before = set(os.listdir("/dev/shm")), _ours()
    sets = ["model.hf_path=runs/tiny-llama-warm", "data.path=runs/arith/train.jsonl",
            "trainer.num_steps=6", "scheduler.validation_every=0", "checkpoint.every_steps=0",
            "checkpoint.save_at_end=false", "engine.max_restarts=0"]  # fmt: skip
    proc = _launch(run_dir, sets, port, log)
    while len(_rows(run_dir / "metrics.jsonl")) < 1:
        if proc.poll() is not None:
            return {"target": target, "problems": [f"the run ended ({proc.returncode}) before "
                                                   f"a step: {log}"]}  # fmt: skip
        time.sleep(0.1)
    victim = {"normal": lambda: None, "agent": lambda: _agent(proc),
              "rank": lambda: rng.choice(_ranks(proc) or [None]),
              "engine": lambda: _scheduler(proc)}[target]()  # fmt: skip
    what = "nothing"
    if victim is not None:
        what = f"SIGKILL of {victim.name()} pid {victim.pid}"
        victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    try:
        code = proc.wait(timeout=grace_s if target == "agent" else 600)
    except subprocess.TimeoutExpired:  # the launcher waits for an agent that is gone
        proc.kill()
        code = proc.wait()
    ended = time.monotonic()
    left, shm_left = [], []
    while time.monotonic() < ended + grace_s:
        left = sorted(_ours() - procs_before)
        shm_left = sorted(set(os.listdir("/dev/shm")) - shm_before)
        if not left and not shm_left:
            break
        time.sleep(0.5)
    gone_s = time.monotonic() - killed
    problems = []
    if left:
        problems.append(
            "processes left: "
            + ", ".join(
                f"{p} {_cmdline(psutil.Process(p))[:80]}" for p in left if psutil.pid_exists(p)
            )
        )
    if shm_left:
        problems.append(f"/dev/shm entries left: {shm_left}")
    if target == "normal" and code != 0:
        problems.append(f"the normal run exited {code}: {log}")
    return {"target": target, "killed": what, "launcher_exit": code,
            "all_gone_s": round(gone_s, 1), "problems": problems}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", nargs="+", default=["normal", "agent", "rank", "engine"],
                        choices=["normal", "agent", "rank", "engine"])  # fmt: skip
    parser.add_argument("--out", default="runs/cleanup-check")
    parser.add_argument("--grace-s", type=float, default=45.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    _prepare()
    rng = random.Random(args.seed)
    results = []
    for i, target in enumerate(args.targets):
        results.append(_check(target, out, args.grace_s, 29770 + 7 * i, rng))
        print(json.dumps(results[-1]), flush=True)
    failed = [r["target"] for r in results if r["problems"]]
    print(f"RESULT cleanup_check={'pass' if not failed else 'fail'} "
          f"targets={len(results)} failed={failed}")  # fmt: skip
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
