"""Checkpoints of the asynchronous loop in one process: what an engine host keeps, and a resume
that trains every prompt once.

Contracts checked:
- `PendingSteps` keeps each untrained step with the stage it reached, forgets the trained ones,
  restores them in step order (refusing a gap) and counts the samples and tokens kept;
- a preemption at version k in either weight-update mode (both sides of the real pipeline over a
  `LocalExchange`, a real `GenerateSide` with its dataset and reward over a `TimedEngine`) stops
  both sides at boundary k after a save that holds the steps generated ahead; the run resumed
  from that save trains steps k..N-1 on exactly the prompts an uninterrupted run trains, each
  token within one version of its step, none regenerated;
- `Resumed` turns a saved state into those steps and the `resume/*` counts.
The manager here is `SyncCheckpoints`, a stand-in that meets both sides at the boundaries with a
barrier and keeps the saved dicts in memory; its real twin, `CheckpointManager` over gloo,
runs in tests/e2e/test_checkpoint_resume.py.
"""

from __future__ import annotations

import threading

import pytest

from megatron_async_rl.checkpoint.config import Preempted
from megatron_async_rl.checkpoint.pending import GENERATED, LOADED, PARTIAL, SCORED, PendingSteps
from megatron_async_rl.jobs.async_checkpoint import Resumed
from megatron_async_rl.jobs.exchange import LocalExchange
from megatron_async_rl.jobs.grpo_async import run_learn_pipeline
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.rollout.generation import Sample
from tests.unit.pipeline_fakes import (
    LedgerLearner,
    SyncCheckpoints,
    TimedEngine,
    make_cfg,
    make_generate_side,
    run_generate,
    stable,
)


def _work(step: int, tokens: int = 0) -> StepWork:
    samples = None
    if tokens:
        samples = [Sample("a:1", 0, 0, [1], [2] * tokens, [0.0] * tokens, ["v0"] * tokens,
                          "stop", "3")]  # fmt: skip
    return StepWork(step=step, cursor={"epoch": 0, "index": step}, samples=samples)


def test_pending_steps_keep_what_is_untrained_with_its_stage():
    pending = PendingSteps()
    for step, stage, tokens in ((3, SCORED, 2), (4, GENERATED, 5), (5, PARTIAL, 4),
                                (6, LOADED, 0)):  # fmt: skip
        pending.record(_work(step, tokens), stage)
    pending.record(_work(2, 1), SCORED)
    pending.drop_before(3)  # version 3 exists: step 2 is trained
    assert pending.first_cursor() == {"epoch": 0, "index": 3}
    state = pending.state_dict()
    assert PendingSteps.counts(state) == {"samples": 2.0, "tokens": 7.0, "partial_tokens": 4.0}
    kept = PendingSteps.restore(state, 3)
    assert {stage: [w.step for w in works] for stage, works in kept.items()} == {
        LOADED: [6], PARTIAL: [5], GENERATED: [4], SCORED: [3],
    }  # fmt: skip
    assert kept[GENERATED][0].samples[0].response_ids == [2] * 5
    assert [w.step for w in PendingSteps.restore(state, 4)[GENERATED]] == [4]
    with pytest.raises(RuntimeError, match="not consecutive"):
        PendingSteps.restore({"steps": state["steps"][::2]}, 3)
    with pytest.raises(ValueError, match="stage 'sent'"):
        pending.record(_work(7), "sent")


def _run(cfg, learner, engine, checkpoints, start=0, resumed=None, cursor=None):
    """Both sides from `start`; returns {side: error} (Preempted where a signal stopped it)."""
    gen = make_generate_side(cfg, engine)
    if cursor is not None:
        gen.dataset.load_state_dict(cursor)
    exchange = LocalExchange(learner.state, timeout_s=60)
    errors: dict[str, BaseException] = {}

    def side(name, fn, *args):
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001 - read by the test
            errors[name] = err

    threads = [
        threading.Thread(target=side, args=(
            "generate", run_generate, gen, exchange, RankClock(1, ("generate",)), cfg,
            1, checkpoints, start, resumed,
        )),
        threading.Thread(target=side, args=(
            "learn", run_learn_pipeline, learner, exchange, RankClock(0, ("train",)), cfg, 0,
            "train", checkpoints, start,
        )),
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a side never finished"
    return errors


@pytest.mark.parametrize("mode", ["wait", "in_flight"])
def test_a_preempted_run_resumes_and_trains_every_prompt_once(tmp_path, mode):
    steps, stop = 8, 3
    cfg = make_cfg(tmp_path, steps=steps, ahead=1, mode=mode, prompts=3, max_new_tokens=6)
    engine = lambda: TimedEngine(token_s=0.002 if mode == "in_flight" else 0.0)  # noqa: E731
    reference = LedgerLearner()
    assert _run(cfg, reference, engine(), SyncCheckpoints(steps)) == {}

    first = LedgerLearner()
    checkpoints = SyncCheckpoints(steps, due=(2,), stop_at=stop)
    errors = _run(cfg, first, engine(), checkpoints)
    assert set(errors) == {"generate", "learn"}, errors
    assert all(isinstance(e, Preempted) for e in errors.values()), errors
    assert sorted(first.ledger) == list(range(stop)) and sorted(checkpoints.saved) == [2, stop]
    saved = checkpoints.saved[stop]
    kept = saved["gen"]["pending"]["steps"]
    assert kept and kept[0]["work"]["step"] == stop  # steps < 3 are trained: forgotten
    assert saved["learn"] == {"trained": stop}

    # Resume as `CheckpointManager.restore` does: learner state, the engine synced to v3.
    second = LedgerLearner(trained=stop)
    resumed_engine = engine()
    LocalExchange(second.state).sync_weights(stop, resumed_engine)
    gen_state = {**saved["gen"]}
    resumed = Resumed(gen_state["pending"], gen_state["validated"], gen_state["validations"],
                      {"resume/samples_restored": 1.0})  # fmt: skip
    errors = _run(cfg, second, resumed_engine, SyncCheckpoints(steps), stop, resumed,
                  gen_state["cursor"])  # fmt: skip
    assert errors == {}, errors
    assert sorted(second.ledger) == list(range(stop, steps))
    trained = {**first.ledger, **second.ledger}
    for step in range(steps):
        assert trained[step][0] == reference.ledger[step][0], step  # the same prompts
        assert all(step - 1 <= v <= step for v in trained[step][1]), (step, trained[step][1])
    assert second.logged[0]["resume/samples_restored"] == 1.0  # on the first resumed step


def test_resumed_reads_the_saved_state_and_counts_it():
    class Chosen:
        chosen = ("/ckpt/step_4", {"step": 4})
        restored = {"gen": {"pending": {"steps": [
            {"stage": SCORED, "work": _work(4, 3).state_dict()},
            {"stage": LOADED, "work": _work(5).state_dict()},
        ]}, "validated": 2, "validations": {4: {"val/x": 1.0}}}}  # fmt: skip

    resumed = Resumed.from_checkpoint(Chosen(), first_host=True)
    assert resumed.validated == 2 and resumed.validations == {4: {"val/x": 1.0}}
    assert resumed.metrics == {
        "resume/partial_tokens_restored": 0.0, "resume/samples_restored": 1.0,
        "resume/tokens_restored": 3.0,
    }  # fmt: skip
    assert [w.step for w in resumed.steps(4)[SCORED]] == [4]
    assert Resumed.from_checkpoint(None, first_host=True).steps(0) == {
        LOADED: [], PARTIAL: [], GENERATED: [], SCORED: [],
    }  # fmt: skip


def test_a_restart_without_a_complete_checkpoint_drops_what_it_logged(tmp_path):
    """Found by `scripts/checkpoint_soak.py`: a world killed before its first checkpoint was
    complete restarted at step 0 and logged steps 0 and 1 again after the old ones."""
    from types import SimpleNamespace

    from megatron_async_rl.checkpoint.manager import CheckpointManager
    from megatron_async_rl.observability.ledger import PromptLedger, read_ledger
    from megatron_async_rl.observability.metrics import MetricsWriter, read_metrics

    learn = SimpleNamespace(writer=MetricsWriter(tmp_path, tensorboard=False),
                            ledger=PromptLedger(tmp_path))  # fmt: skip
    for step in (0, 1):  # the killed attempt
        learn.writer.log(step, {"reward/mean": 0.5})
        learn.ledger.log(step, ["a:1"], (step, step))
    manager = CheckpointManager.__new__(CheckpointManager)  # restore's state only
    manager.chosen, manager.root = (None, None), tmp_path / "checkpoints"
    manager.cfg = SimpleNamespace(run_dir=str(tmp_path))
    assert manager.restore(None, learn, None) == 0
    learn.writer.log(0, {"reward/mean": 0.25})
    learn.ledger.log(0, ["a:1"], (0, 0))
    learn.writer.close()
    learn.ledger.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0]
    assert [r["step"] for r in read_ledger(tmp_path / "ledger.jsonl")] == [0]


def _stages(saved: dict) -> dict[int, str]:
    """Step -> the stage it had reached, in an engine host's save (`SyncCheckpoints.saved[v]`)."""
    return {entry["work"]["step"]: entry["stage"] for entry in saved["gen"]["pending"]["steps"]}


@pytest.mark.parametrize("mode", ["wait", "in_flight"])
def test_at_n0_a_save_waits_for_the_step_the_learner_trains_next(tmp_path, mode):
    """N = 0, a save at every boundary, the learner 0.1 s late to each: by then the engine host
    has loaded version v and is generating step v, the learner's next step. The save waits for
    that generation instead of cutting it, so the run is the run without saves: every step's
    metrics equal, no prefix continued (a continued response is prefilled again, and on a real
    engine its log-probs differ from the uncut one's in the last bits: found by
    tests/cluster/test_multihost.py). Each save holds step v generated whole. A stop still cuts
    it: the learner will not train it in that run."""
    steps = 4
    cfg = make_cfg(tmp_path, steps=steps, ahead=0, mode=mode, prompts=2, max_new_tokens=12)
    engine = lambda: TimedEngine(token_s=0.02)  # noqa: E731  (0.24 s a generation)
    reference = LedgerLearner()
    assert _run(cfg, reference, engine(), SyncCheckpoints(steps)) == {}

    learner = LedgerLearner()
    checkpoints = SyncCheckpoints(steps, due=(1, 2, 3), learner_late_s=0.1)
    assert _run(cfg, learner, engine(), checkpoints) == {}
    assert [stable(m) for m in learner.logged] == [stable(m) for m in reference.logged]
    assert not any("rollout/prefix_tokens_kept" in m for m in learner.logged)
    for version in (1, 2, 3):
        kept = _stages(checkpoints.saved[version])
        assert kept[version] == GENERATED and PARTIAL not in kept.values(), (version, kept)

    stopped = SyncCheckpoints(steps, stop_at=2, learner_late_s=0.1)
    errors = _run(cfg, LedgerLearner(), engine(), stopped)
    assert all(isinstance(e, Preempted) for e in errors.values()) and len(errors) == 2, errors
    kept = _stages(stopped.saved[2])
    assert kept[2] == PARTIAL, kept


@pytest.mark.parametrize("mode", ["wait", "in_flight"])
def test_a_save_cuts_the_generation_in_progress_and_the_prefixes_are_continued(tmp_path, mode):
    """One step ahead, training (0.3 s) slower than generation (0.24 s), the learner 0.1 s
    late to each boundary: every save lands while step v + 1 is being generated, which the
    learner does not need yet. The generation is cut, the step saved as partial (its prefixes,
    log-probs and versions), then continued in the same run; the run preempted at version 3
    resumes from those prefixes. Every prompt is trained once, each token within the window,
    prefixes counted."""
    steps, stop = 6, 3
    cfg = make_cfg(tmp_path, steps=steps, ahead=1, mode=mode, prompts=2, max_new_tokens=12)
    engine = lambda: TimedEngine(token_s=0.02)  # noqa: E731  (0.24 s a generation)
    train_s = lambda stage, step: 0.3 if stage == "train" else 0.0  # noqa: E731
    reference = LedgerLearner()
    assert _run(cfg, reference, engine(), SyncCheckpoints(steps)) == {}

    first = LedgerLearner(durations=train_s)
    checkpoints = SyncCheckpoints(steps, due=(1, 2), stop_at=stop, learner_late_s=0.1)
    errors = _run(cfg, first, engine(), checkpoints)
    assert all(isinstance(e, Preempted) for e in errors.values()) and len(errors) == 2, errors
    partial = [
        entry for version in (1, 2, stop)
        for entry in checkpoints.saved[version]["gen"]["pending"]["steps"]
        if entry["stage"] == PARTIAL
    ]  # fmt: skip
    assert partial, "no save found a generation in progress"
    for version in (1, 2):  # cut: step v + 1; not cut: step v, the learner's next
        kept = _stages(checkpoints.saved[version])
        assert kept[version + 1] == PARTIAL and kept[version] != PARTIAL, (version, kept)
    for entry in partial:
        samples = entry["work"]["samples"]
        assert all(s["finish_reason"] == "abort" for s in samples)
        assert all(len(s["response_ids"]) == len(s["token_versions"]) for s in samples)
    # the steps cut before the stop were continued in that run: their responses are whole
    continued = [m for m in first.logged if m.get("rollout/prefix_tokens_kept", 0) > 0]
    saved = checkpoints.saved[stop]["gen"]
    restored = PendingSteps.counts(saved["pending"])["partial_tokens"]
    assert continued and restored > 0

    second = LedgerLearner(trained=stop, durations=train_s)
    resumed_engine = engine()
    LocalExchange(second.state).sync_weights(stop, resumed_engine)
    resumed = Resumed(saved["pending"], saved["validated"], saved["validations"],
                      {"resume/partial_tokens_restored": restored})  # fmt: skip
    assert _run(cfg, second, resumed_engine, SyncCheckpoints(steps), stop, resumed,
                saved["cursor"]) == {}  # fmt: skip
    trained = {**first.ledger, **second.ledger}
    assert sorted(trained) == list(range(steps))
    for step in range(steps):
        assert trained[step][0] == reference.ledger[step][0], step  # the same prompts, once
        assert all(step - 1 <= v <= step for v in trained[step][1]), (step, trained[step][1])
        assert len(trained[step][1]) == 2 * 2 * 12  # every response whole (12 tokens)
    assert second.logged[0]["resume/partial_tokens_restored"] == restored
    # A step saved partial continues from its prefixes in the resumed run: its row counts them,
    # on top of what an earlier cut of the same step counted before the save. (The first
    # resumed row is step `stop`, which a save before the stop may have cut and continued.)
    partial_at_stop = [e["work"] for e in saved["pending"]["steps"] if e["stage"] == PARTIAL]
    tokens = [sum(len(s["response_ids"]) for s in w["samples"]) for w in partial_at_stop]
    assert sum(tokens) == restored
    rows = {row["step"]: row for row in second.logged}
    for work, kept in zip(partial_at_stop, tokens, strict=True):
        before = work["report"]["sums"].get("rollout/prefix_tokens_kept", 0.0)
        row = rows[work["step"]]
        assert row["rollout/prefix_tokens_kept"] == before + kept, (work["step"], row)
