"""The quick start on one GPU with two ranks, and a killed-and-resumed run (issue 37, part 3).

    python scripts/gpu_engine_checks.py --out DIR [--device cuda] [--steps 20]

Run by `bash scripts/gpu_checks.sh engine` on a GPU machine: rank 0 holds the Megatron roles
(train, logp, ref), rank 1 the SGLang engine, both on GPU 0 (`platform.backend=gloo`; the
weights cross by the host bridge). The engine takes `engine.mem_fraction_static` of the GPU.
It runs three things:
1. the quick start (`yaml_configs/tiny-grpo-cpu.yaml`), synchronous, `--steps` steps;
2. its one-step-ahead twin (`tiny-grpo-async-cpu.yaml`), `--steps` steps;
3. a synchronous run of 6 steps with checkpoints every 3 and SGLang's deterministic inference
   (`enable_deterministic_inference`, triton attention). Run once uninterrupted, then again with
   one rank killed (SIGKILL) once version 3 is saved, then resumed by the same command.
   The learning metrics of each step (reward, loss, log-probs, ...: `LEARNING`) are compared.
It prints, for 1 and 2, the median step time, the engine-vs-trainer log-prob gap, and the
median weight sync time next to a raw copy of the same bytes (on the GPU, and host to GPU).
For 3 it prints the metrics that differ. The last line is `RESULT ...`. With `--device cpu` the
same runs go on CPU (a check of this script; CPU sampling is not reproducible across a resume).
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.recipes import (  # noqa: E402
    launch_command,
    launch_env,
    launcher_ranks,
    logged_steps,
    wait_for,
)

SYNC = REPO / "yaml_configs/tiny-grpo-cpu.yaml"
AHEAD = REPO / "yaml_configs/tiny-grpo-async-cpu.yaml"
LEARNING = ("actor/", "data/", "entropy/", "kl/", "logprob/", "mismatch/", "offpolicy/",
            "response_len/", "reward/", "samples/")  # fmt: skip


def prepare(work: Path) -> dict[str, Path]:
    """The quick start's model, data and warm start (`scripts/quickstart.sh`), under `work`."""
    paths = {"model": work / "tiny-llama", "train": work / "arith/train.jsonl",
             "eval": work / "arith/eval.jsonl", "warm": work / "tiny-llama-warm"}  # fmt: skip
    py = [sys.executable, "-m"]
    steps = [
        ("model", [*py, "megatron_async_rl.models.tiny", "--family", "llama", "--out",
                   paths["model"], "--seed", "0"]),
        ("train", [*py, "megatron_async_rl.tasks.arithmetic", "--out", paths["train"],
                   "--num-rows", "2000", "--seed", "0"]),
        ("eval", [*py, "megatron_async_rl.tasks.arithmetic", "--out", paths["eval"],
                  "--num-rows", "64", "--seed", "1"]),
        ("warm", [*py, "megatron_async_rl.tasks.warm_start", "--model", paths["model"],
                  "--data", paths["train"], "--out", paths["warm"], "--seed", "0"]),
    ]  # fmt: skip
    for key, cmd in steps:
        if not paths[key].exists():
            subprocess.run([str(c) for c in cmd], check=True, cwd=REPO)
    return paths


def base_sets(paths: dict[str, Path], device: str) -> list[str]:
    sets = [f"model.hf_path={paths['warm']}", f"data.path={paths['train']}",
            f"validation.data.path={paths['eval']}", f"platform.device={device}",
            "platform.backend=gloo"]  # fmt: skip
    if device == "cuda":  # two ranks on one GPU: the engine leaves the rest to Megatron
        sets.append("engine.mem_fraction_static=0.3")
    return sets


def run(recipe: Path, run_dir: Path, sets: list[str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(launch_command(recipe, run_dir, *sets), env=launch_env(), cwd=REPO,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)  # fmt: skip
    proc.log = log
    return proc


def finish(proc, what: str, timeout: float = 900) -> int:
    proc.wait(timeout=timeout)
    if proc.returncode != 0:
        print(f"{what}: exit {proc.returncode}; its log ends:\n{proc.log.read_text()[-3000:]}")
    return proc.returncode


def figures(rows: list[dict]) -> dict[str, float]:
    later = [r for r in rows if r["step"] >= 2] or rows  # steps 0-1 hold start-up costs

    def median(key):
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else float("nan")

    return {
        "step_s": median("timing/step_s"),
        "logp_gap": median("logprob/engine_vs_train_abs_diff"),
        "sync_s": median("timing/weight_sync_s"),
        "sync_GB": median("weight_sync/GB"),
        "reward_first": rows[0].get("reward/mean", float("nan")),
        "reward_last5": statistics.mean(r.get("reward/mean", 0.0) for r in rows[-5:]),
    }


def raw_copy_s(gigabytes: float, device: str) -> tuple[float, float]:
    """Seconds for a copy of `gigabytes` on `device` and from pinned host memory to it."""
    nbytes = max(1, int(gigabytes * 1e9))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn) -> float:
        times = []
        for _ in range(5):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    return timed(src.clone), timed(lambda: host.to(device, non_blocking=True))


def resume_check(paths, device: str, out: Path) -> tuple[bool, list[str]]:
    sets = [*base_sets(paths, device), "trainer.num_steps=6", "checkpoint.every_steps=3"]
    if device == "cuda":
        sets.append("engine.server_args.enable_deterministic_inference=true")
    whole = out / "resume-uninterrupted"
    if finish(run(SYNC, whole, sets, out / "resume-uninterrupted.log"), "uninterrupted") != 0:
        return False, ["the uninterrupted run failed"]
    broken = out / "resume-killed"
    proc = run(SYNC, broken, sets, out / "resume-killed.log")
    wait_for(lambda: (broken / "checkpoints/step_00000003/manifest.json").exists(), proc,
             "checkpoint v3")  # fmt: skip
    random.choice(launcher_ranks(proc)).send_signal(signal.SIGKILL)
    proc.wait(timeout=300)
    if finish(run(SYNC, broken, sets, out / "resume-resumed.log"), "resumed") != 0:
        return False, ["the resumed run failed"]
    a = {r["step"]: r for r in logged_steps(whole)}
    b = {r["step"]: r for r in logged_steps(broken)}
    if sorted(a) != sorted(b):
        return False, [f"steps {sorted(a)} vs {sorted(b)}"]
    differ = sorted({f"{k} (step {s})" for s in a for k in a[s]
                     if k.startswith(LEARNING) and a[s].get(k) != b[s].get(k)})  # fmt: skip
    return not differ, differ


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-resume", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = prepare(args.out / "work")
    result = {}
    for name, recipe in (("sync", SYNC), ("ahead", AHEAD)):
        run_dir = args.out / f"quickstart-{name}"
        sets = [*base_sets(paths, args.device), f"trainer.num_steps={args.steps}"]
        if finish(run(recipe, run_dir, sets, args.out / f"quickstart-{name}.log"), name) != 0:
            result[f"{name}_ok"] = False
            continue
        f = figures(logged_steps(run_dir))
        on_device, host_to_device = raw_copy_s(f["sync_GB"], args.device)
        print(f"{name}: step {f['step_s']:.3f} s (median of steps 2+), reward "
              f"{f['reward_first']:.2f} -> {f['reward_last5']:.2f} (last 5), engine-vs-trainer "
              f"log-prob gap {f['logp_gap']:.2e}, weight sync {f['sync_s'] * 1e3:.1f} ms for "
              f"{f['sync_GB'] * 1e3:.1f} MB; a raw copy of it: {on_device * 1e3:.2f} ms on the "
              f"device, {host_to_device * 1e3:.2f} ms host to device")  # fmt: skip
        result.update({
            f"{name}_ok": True,
            f"{name}_step_s": round(f["step_s"], 4),
            f"{name}_logp_gap": f"{f['logp_gap']:.2e}",
            f"{name}_sync_vs_raw_h2d": round(host_to_device / f["sync_s"], 4),
        })
    if not args.skip_resume:
        equal, differ = resume_check(paths, args.device, args.out)
        print(f"killed and resumed vs uninterrupted: {'equal' if equal else 'different'}"
              + ("" if equal else f": {', '.join(differ[:12])}"))  # fmt: skip
        result["resume_equal"] = equal
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0 if all(v is not False for v in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
