"""Runs through a crash and a preemption, resumed each time, to their last step: the
synchronous loop (below) and the asynchronous one (`test_the_asynchronous_loop_...`: its
docstring).

Contract, on the real stack through `launch/torchrun.sh` (2 ranks: train+logp | a real
SGLang engine), with `checkpoint.every_steps=2` and 6 steps:
1. once `step_00000002` is published, one rank chosen at random is killed with SIGKILL: the
   world ends (non-zero) and nothing newer than a complete checkpoint is kept;
2. the same command resumes from version 2 by itself (`--resume auto`); once it logs a step,
   SIGTERM to the launcher makes every rank save at the next step boundary: the launcher
   exits 83 and a newer complete checkpoint exists;
3. the same command resumes from it and runs to the end.
Afterwards `metrics.jsonl` holds steps 0-5 exactly once each (what the killed run logged after
its checkpoint is dropped), the resumed steps carry `resume/from_step`, the final checkpoint
is version 6, and HF exports of versions 3 and 6 exist. Exactness of the resumed training
state is `tests/distributed/test_checkpoint_megatron.py`'s; the sampled tokens differ after a
resume on CPU (SGLang's sampler draws from the engine process's generator: README,
Checkpoints).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time

import pytest

from tests.harness.recipes import (
    RECIPE,
    end_of_run,
    launch_command,
    launch_env,
    launcher_ranks,
    logged_steps,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # crash-and-restart runs of the entry point

SETS = ("trainer.num_steps=6", "checkpoint.every_steps=2", "checkpoint.hf_export_every=3")


def _start(task, run_dir, log):
    """The launcher, its output in `log` (a file: a pipe nobody reads would fill and block)."""
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", *SETS)
    proc = subprocess.Popen(
        launch_command(RECIPE, run_dir, *sets), env=launch_env(),
        stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    proc.log = log
    return proc


@pytest.mark.fault_soak  # minutes: scripts/fault_checks.sh runs it
def test_a_crash_and_a_preemption_resume_to_the_end(task, tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    # 1. SIGKILL one rank once version 2 is published.
    proc = _start(task, run_dir, tmp_path / "crash.log")
    wait_for(lambda: (ckpts / "step_00000002" / "manifest.json").exists(), proc, "checkpoint v2")
    victim = random.choice(launcher_ranks(proc))
    victim.send_signal(signal.SIGKILL)
    out = end_of_run(proc)
    assert proc.returncode != 0, out
    published = sorted(p.name for p in ckpts.glob("step_*"))
    assert published and published[0] == "step_00000002", published

    # 2. Resume by itself; SIGTERM to the launcher while its own next save is being written
    #    (its writer's processes exist: they must outlive the signal, which torchrun sends to
    #    each rank's whole process group).
    before = {r["step"] for r in logged_steps(run_dir)}
    started = time.time()
    proc = _start(task, run_dir, tmp_path / "preempted.log")
    wait_for(lambda: any("resume/from_step" in r for r in logged_steps(run_dir)), proc,
             "a resumed step")  # fmt: skip
    resumed_from = int(
        next(r for r in logged_steps(run_dir) if "resume/from_step" in r)["resume/from_step"]
    )
    assert resumed_from >= 2 and resumed_from <= max(before) + 1
    own = resumed_from + 2 - resumed_from % 2
    if own < 6:  # its next save being written (not the last: the run must still be going)
        partial = ckpts / f".partial_step_{own:08d}"

        def writing() -> bool:
            try:
                return partial.stat().st_mtime > started
            except FileNotFoundError:
                return False

        wait_for(writing, proc, f"the resumed run's save of v{own}")
    proc.send_signal(signal.SIGTERM)
    out = end_of_run(proc)
    assert proc.returncode == 83, out
    newest = max(int(p.name.split("_")[1]) for p in ckpts.glob("step_*"))
    assert newest > resumed_from

    # 3. Resume again and finish.
    proc = _start(task, run_dir, tmp_path / "end.log")
    out = end_of_run(proc)
    assert proc.returncode == 0, out
    rows = logged_steps(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    resumes = [r["step"] for r in rows if "resume/from_step" in r]
    assert resumes == [resumed_from, newest], resumes
    assert (ckpts / "step_00000006" / "manifest.json").exists()
    assert not list(ckpts.glob(".partial_*"))
    # The HF exports (`checkpoint.hf_export_every`): loadable, every tensor of the model.
    from megatron_async_rl.models.hf_checkpoint import HFTensorReader

    start = set(HFTensorReader(task.model).keys())
    for version in (3, 6):
        assert set(HFTensorReader(ckpts / f"hf_step_{version:08d}").keys()) == start

    # 4. Another recipe (the algorithm differs) would resume from it: the launcher stops with
    #    exit 2 and one line, before any rank starts.
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", *SETS,
            "algorithm.clip_ratio_low=0.3")  # fmt: skip
    proc = subprocess.run(launch_command(RECIPE, run_dir, *sets), env=launch_env(validate=True),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "differs in algorithm.clip_ratio_low" in lines[0], lines


def test_a_run_resumes_with_its_schedule_and_data_cursor(task, sync_run, tmp_path):
    """The shared synchronous run (`sync_run`: 4 steps, checkpoints of versions 2 and 4),
    resumed from version 2 into a new run directory with `--resume PATH`: steps 2 and 3 are
    trained again, the first marked `resume/from_step` 2; the restored state is the saved one
    where a resumed run can show it exactly: the learning-rate schedule (`actor/lr` of both
    steps equals the uninterrupted run's: 8 optimizer steps already taken) and the data cursor
    (the same prompts at both steps, `ledger.jsonl`); the run saves version 4 at its end. The
    sampled tokens are not compared (SGLang's sampler: module docstring)."""
    from megatron_async_rl.observability.ledger import read_ledger
    from tests.harness.recipes import SYNC_SETS, run_recipe

    saved = sync_run.run_dir / "checkpoints" / "step_00000002"
    assert (saved / "manifest.json").exists(), sorted(saved.parent.iterdir())
    run_dir = tmp_path / "resumed"
    rows = run_recipe(task, run_dir, *SYNC_SETS, f"validation.data.path={task.val}",
                      f"checkpoint.resume={saved}").rows  # fmt: skip
    assert [r["step"] for r in rows] == [2, 3]
    assert rows[0]["resume/from_step"] == 2 and "resume/from_step" not in rows[1]
    before = {r["step"]: r for r in sync_run.rows}
    for row in rows:
        assert row["actor/lr"] == before[row["step"]]["actor/lr"], row["step"]
        assert row["actor/optimizer_steps"] == 4
    prompts = {r["step"]: r["prompts"] for r in read_ledger(sync_run.run_dir / "ledger.jsonl")}
    resumed = {r["step"]: r["prompts"] for r in read_ledger(run_dir / "ledger.jsonl")}
    assert resumed == {2: prompts[2], 3: prompts[3]}
    assert (run_dir / "checkpoints" / "step_00000004" / "manifest.json").exists()


ASYNC_RECIPE = RECIPE.parent / "tiny-grpo-async-cpu.yaml"


@pytest.mark.fault_soak  # minutes: scripts/fault_checks.sh runs it
def test_the_asynchronous_loop_loses_nothing_through_a_kill_during_a_save(task, tmp_path):
    """`yaml_configs/tiny-grpo-async-cpu.yaml` (one step ahead, weights loaded in flight,
    responses long enough that loads land mid-generation), a checkpoint every 2 versions of 8,
    launched with `MAX_RESTARTS=1`. A random rank is killed with SIGKILL while version 4 is
    being written (its partial directory exists): torchrun restarts the world, which resumes
    by itself from version 2 with the engine host's untrained steps
    (generated samples, `resume/tokens_restored`, and the prefixes of the generation the save
    cut, `resume/partial_tokens_restored`, continued after the resume; together > 0) and
    finishes: the launcher exits 0. The ledger then holds steps 0-7 once each, 128 prompts,
    none twice (the data has 200 rows: one epoch), and every token within one version of its
    step."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", "trainer.num_steps=8",
            "checkpoint.every_steps=2", "scheduler.validation_every=0",
            "scheduler.weight_update_mode=in_flight", "rollout.max_new_tokens=16")  # fmt: skip
    proc = subprocess.Popen(launch_command(ASYNC_RECIPE, run_dir, *sets),
                            env=dict(launch_env(), MAX_RESTARTS="1"),
                            stdout=open(tmp_path / "run.log", "w"), stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    proc.log = tmp_path / "run.log"
    wait_for(lambda: (ckpts / ".partial_step_00000004").exists(), proc, "the save of v4")
    random.choice(launcher_ranks(proc)).send_signal(signal.SIGKILL)
    out = end_of_run(proc)
    assert proc.returncode == 0, out
    rows = logged_steps(run_dir)
    assert [r["step"] for r in rows] == list(range(8)), out
    resumed = [r for r in rows if "resume/from_step" in r]
    assert len(resumed) == 1 and resumed[0]["step"] == 2, resumed
    print(f"\nresumed: { {k: v for k, v in resumed[0].items() if k.startswith('resume/')} }")
    kept = resumed[0]["resume/tokens_restored"] + resumed[0]["resume/partial_tokens_restored"]
    assert kept > 0  # whole samples, or prefixes of a generation the save cut
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ledger] == list(range(8))
    prompts = [uid for r in ledger for uid in r["prompts"]]
    assert len(prompts) == 8 * 16 and len(set(prompts)) == len(prompts)
    assert all(r["step"] - 1 <= r["versions"][0] <= r["versions"][1] <= r["step"] for r in ledger)
    assert (ckpts / "step_00000008" / "manifest.json").exists()
