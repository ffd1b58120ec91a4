"""Multi-turn tool use on CPU: learning (sync vs async) and tool-latency overlap, side by side.

    .venv/bin/python benchmarks/multiturn_tools.py [--steps 40] [--throughput-steps 12]
        [--out runs/bench-tools] [--skip-learning] [--skip-throughput] [--task sum|price]

Writes the calculator task and the tool-call warm start (`scripts/tools_quickstart.sh`'s), then
runs `yaml_configs/tiny-tools-cpu.yaml` through `launch/torchrun.sh` on 2 ranks:
- learning: the synchronous loop and the asynchronous loop (`generate_ahead_steps: 1`,
  in-flight updates), `--steps` each; prints the reward of the first and last 5 steps and the
  wall time of each, and writes `<out>/learning.png` (reward against step and against time);
- throughput: the asynchronous loop with `add` (instant) and with the same tool sleeping 100 ms
  per call (`benchmarks/slow_tools.py:add`), and adding in the sandbox in 200 ms
  (`slow_tools.py:sandboxed_add`: a bubblewrap run that sleeps 200 ms), `--throughput-steps`
  each, 16 tool workers, 128 trajectories a step, and the ratios of their mean step times
  after 2 warm-up steps (overlap works when they are near 1).
`--task price` is the two-step task instead (rows `pear+348=`: `price(item)`, then
`add(price, n)`, then the answer; 3 turns, tools `price` and `add`); `--task code` the code task
(`yaml_configs/tiny-code-cpu.yaml`: rows `348*576=`, the model writes `print(348*576)` for the
built-in `python` tool, run in the sandbox, then copies its output).
Last line: `RESULT sync_gain=<float> async_gain=<float> slow_tool_step_ratio=<float>
sandboxed_tool_step_ratio=<float>`.
A benchmark, not a test: the runs share this machine's noise; read the ratios.
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
PY = sys.executable


_CALC = "megatron_async_rl.tasks.calculator"
TASKS = {
    # task: (the rows' command line, recipe, the recipe's overrides, the plot's title)
    "sum": ([_CALC, "--task", "sum"], "tiny-tools-cpu.yaml", (), "tiny Llama + calculator tool"),
    "price": ([_CALC, "--task", "price"], "tiny-tools-cpu.yaml", (
        f"environment.tools=[{_CALC}:price,{_CALC}:add]", "environment.max_turns=3",
        "environment.max_total_tokens=256", "megatron.seq_length=320",
    ), "tiny Llama + calculator tool"),
    "code": (["megatron_async_rl.tasks.code_task"], "tiny-code-cpu.yaml", (),
             "tiny Llama writing Python for the sandboxed python tool"),
}  # fmt: skip


def _prepare(out: Path, task: str) -> tuple[Path, Path]:
    model, data, warm = (out / "tiny-llama", out / f"{task}.jsonl",
                         out / f"tiny-llama-{task}-warm")  # fmt: skip
    if not (model / "config.json").exists():
        subprocess.run([PY, "-m", "megatron_async_rl.models.tiny", "--family", "llama",
                        "--out", str(model), "--seed", "0"], check=True, cwd=REPO)  # fmt: skip
    if not data.exists():
        rows = TASKS[task][0]
        subprocess.run([PY, "-m", rows[0], "--out", str(data), "--num-rows", "2000", "--seed",
                        "0", *rows[1:]], check=True, cwd=REPO)  # fmt: skip
    if not (warm / "config.json").exists():
        subprocess.run([PY, "-m", "megatron_async_rl.tasks.tool_warm_start", "--model",
                        str(model), "--data", str(data), "--out", str(warm), "--seed", "0",
                        "--task", task], check=True, cwd=REPO)  # fmt: skip
    return warm, data


def _run(name: str, out: Path, warm: Path, data: Path, port: int, *sets: str,
         recipe: str = "tiny-tools-cpu.yaml") -> list[dict]:  # fmt: skip
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(REPO / "yaml_configs" / recipe),
           "--run-dir", str(run_dir)]  # fmt: skip
    for item in (f"model.hf_path={warm}", f"data.path={data}", *sets):
        cmd += ["--set", item]
    env = dict(os.environ, PYTHON=PY, NPROC_PER_NODE="2", MASTER_PORT=str(port),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))  # fmt: skip
    log = out / f"{name}.log"
    with log.open("w") as handle:
        proc = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}; see {log}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _step_up(rows: list[dict], gain: float) -> int | None:
    """The first step whose mean reward over it and the 4 before is `gain` over step 0's."""
    start = rows[0]["reward/mean"]
    for i in range(4, len(rows)):
        if _mean([r["reward/mean"] for r in rows[i - 4 : i + 1]]) >= start + gain:
            return rows[i]["step"]
    return None


def _plot(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in curves.items():
        steps = [r["step"] for r in rows]
        rewards = [r["reward/mean"] for r in rows]
        elapsed, total = [], 0.0
        for r in rows:
            total += r["timing/step_s"]
            elapsed.append(total / 60)
        by_step.plot(steps, rewards, label=name)
        by_time.plot(elapsed, rewards, label=name)
    by_step.set_xlabel("RL step")
    by_time.set_xlabel("minutes (sum of step times)")
    for ax in (by_step, by_time):
        ax.set_ylabel("reward/mean (final answer right)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--throughput-steps", type=int, default=12)
    parser.add_argument("--out", default="runs/bench-tools")
    parser.add_argument("--skip-learning", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--task", choices=tuple(TASKS), default="sum")
    args = parser.parse_args(argv)
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    warm, data = _prepare(out, args.task)
    _, recipe, task_sets, title = TASKS[args.task]
    title += ", GRPO on 2 CPU ranks"
    result = {}
    if not args.skip_learning:
        curves = {}
        for name, port, sets in (
            ("sync", 29811, ()),
            ("async", 29812, ("scheduler.generate_ahead_steps=1",
                              "scheduler.weight_update_mode=in_flight")),
        ):  # fmt: skip
            rows = _run(name, out, warm, data, port, f"trainer.num_steps={args.steps}",
                        *task_sets, *sets, recipe=recipe)
            curves[name] = rows
            first, last = (_mean([r["reward/mean"] for r in part])
                           for part in (rows[:5], rows[-5:]))  # fmt: skip
            wall = sum(r["timing/step_s"] for r in rows)
            print(f"{name}: reward first 5 steps {first:.3f}, last 5 {last:.3f} (gain "
                  f"{last - first:+.3f}); {len(rows)} steps in {wall / 60:.1f} min; first step "
                  f"{rows[0]['reward/mean']:.3f}, +0.3 over it (5-step mean) at step "
                  f"{_step_up(rows, 0.3)}")  # fmt: skip
            result[f"{name}_gain"] = last - first
        _plot(curves, out / "learning.png", title)
        print(f"curves: {out / 'learning.png'}")
    if not args.skip_throughput and args.task != "sum":
        print(f"throughput: measured on --task sum only (not {args.task}); skipped")
    elif not args.skip_throughput:
        steps = {}
        tools = (("instant", 29813, "megatron_async_rl.tasks.calculator:add"),
                 ("slow", 29814, "benchmarks.slow_tools:add"),
                 ("sandboxed", 29815, "benchmarks.slow_tools:sandboxed_add"))
        for name, port, tool in tools:
            rows = _run(f"tool-{name}", out, warm, data, port,
                        f"trainer.num_steps={args.throughput_steps}",
                        f"environment.tools=[{tool}]",
                        "environment.tool_workers=16", "scheduler.generate_ahead_steps=1",
                        "scheduler.weight_update_mode=in_flight")  # fmt: skip
            steps[name] = _mean([r["timing/step_s"] for r in rows[2:]])
            calls = _mean([r["multiturn/tool_calls"] for r in rows[2:]])
            print(f"async, {name} tool: mean step {steps[name]:.2f} s over {len(rows) - 2} steps "
                  f"({calls:.0f} tool calls per step)")  # fmt: skip
        result["slow_tool_step_ratio"] = steps["slow"] / steps["instant"]
        result["sandboxed_tool_step_ratio"] = steps["sandboxed"] / steps["instant"]
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
