"""The asynchronous pipeline in one process: scheduler threads, staleness admission, in-flight
weight loads, validation gating, timeouts, and the one clock.

Contracts checked (each run takes well under a second to a few seconds):
- at `generate_ahead_steps: 0` the asynchronous pipeline logs exactly what the synchronous loop
  (`jobs/grpo_sync.run_steps`, an independent schedule) logs, validation included;
- at N = 1 and N = 2, over 200 steps with randomised stage durations, no token is trained more
  than N versions after the one that produced it, and generation does run ahead (lag N occurs);
- with in-flight loads (pause `retract` and `in_place`), samples mix versions within the bound,
  the generate machine is PAUSED during each in-flight load, the cache is flushed with the load
  (retract) or only with the engine idle (in_place; the engine refuses otherwise, as SGLang
  does), and 20 repeated runs of each never fail;
- a stage that stops producing ends the run with a `StageTimeout` naming the most upstream
  waiting stage (the cause), not a downstream symptom;
- validation `exact` evaluates every due version and never lets a load pass an unevaluated due
  version; `latest` never holds a load back;
- `timing/<stage>_s`, `utilization/*`, the trace and the machines' busy seconds are views of one
  set of spans and agree; a rank that waits is never counted busy.
Faked: the engine (`TimedEngine`, a `FakeEngine` with time) and the learner (`FakeLearner`), see
`pipeline_fakes.py`; everything else is the package's own code (`GenerateSide`, dataset, reward,
validator, `Scheduler`, `StageMachine`, `LocalExchange`, `RankClock`, `WeightReceiver`).
"""

from __future__ import annotations

import random
import threading

import pytest

from megatron_async_rl.jobs.exchange import LocalExchange
from megatron_async_rl.jobs.grpo_sync import run_steps
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.observability.utilization import busy_idle
from megatron_async_rl.rollout.validation import SEED_STEP_OFFSET
from megatron_async_rl.scheduler.states import StageTimeout
from tests.unit.pipeline_fakes import (
    FakeLearner,
    TimedEngine,
    make_cfg,
    make_generate_side,
    run_async,
    stable,
)


def test_zero_steps_ahead_is_the_synchronous_loop_exactly(tmp_path):
    cfg = make_cfg(tmp_path, steps=6, ahead=0, validation_every=2)
    sync_engine, sync_learner = TimedEngine(), FakeLearner()
    sync_clock = RankClock(0, ("generate", "train"))
    exchange = LocalExchange(sync_learner.state)
    run_steps(make_generate_side(cfg, sync_engine), sync_learner, exchange, sync_clock, cfg)

    async_learner = FakeLearner()
    run_async(cfg, TimedEngine(), async_learner)
    assert len(sync_learner.logged) == len(async_learner.logged) == 6
    for want, got in zip(sync_learner.logged, async_learner.logged):
        assert stable(got) == stable(want)
    assert [m["val/version"] for m in sync_learner.logged if "val/version" in m] == [0, 2, 4]


@pytest.mark.parametrize("ahead", [1, 2])
def test_lag_bound_holds_on_every_token_over_200_steps_with_random_durations(tmp_path, ahead):
    rng = random.Random(ahead)
    table = {(s, k): rng.choice([0.0, 0.0, 0.001, 0.003]) for s in ("logp", "ref", "train")
             for k in range(200)}  # fmt: skip
    learner = FakeLearner(lambda stage, step: table[stage, step])
    cfg = make_cfg(tmp_path, steps=200, ahead=ahead, max_new_tokens=2)
    run_async(cfg, TimedEngine(token_s=0.0005), learner)
    lags = [m["policy_lag/max"] for m in learner.logged]
    assert len(lags) == 200 and max(lags) <= ahead
    assert ahead in lags, "generation never ran ahead"
    assert [m["step"] for m in learner.logged] == list(range(200))


PPO_ROLES = ("train", "logp", "ref", "reward_model", "critic", "generate")


def test_critic_stages_at_zero_steps_ahead_are_the_synchronous_loop(tmp_path):
    cfg = make_cfg(tmp_path, steps=4, ahead=0, roles=PPO_ROLES)
    sync_learner = FakeLearner()
    run_steps(make_generate_side(cfg, TimedEngine()), sync_learner,
              LocalExchange(sync_learner.state), RankClock(0, ("generate", "train")), cfg)
    async_learner = FakeLearner()
    run_async(cfg, TimedEngine(), async_learner)
    assert [stable(m) for m in async_learner.logged] == [stable(m) for m in sync_learner.logged]
    want = ["logp", "ref", "reward_model", "critic_values", "train", "critic_train"]
    for learner in (sync_learner, async_learner):
        assert [name for name, step in learner.events if step == 2] == want
        assert [m["critic/values_from"] for m in learner.logged] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("ahead", [1, 2])
def test_critic_values_wait_for_the_critic_trained_through_the_step_before(tmp_path, ahead):
    """Generation runs ahead, the critic's stages are slow at random: the values of step k are
    always those of the critic trained through step k - 1, as in the synchronous loop."""
    rng = random.Random(ahead)
    stages = ("logp", "ref", "critic_values", "train", "critic_train")
    table = {(s, k): rng.choice([0.0, 0.001, 0.004]) for s in stages for k in range(60)}
    learner = FakeLearner(lambda stage, step: table.get((stage, step), 0.0))
    cfg = make_cfg(tmp_path, steps=60, ahead=ahead, max_new_tokens=2,
                   roles=("train", "logp", "ref", "critic", "generate"))  # fmt: skip
    _, clock = run_async(cfg, TimedEngine(token_s=0.0005), learner)
    assert [m["critic/values_from"] for m in learner.logged] == [float(k) for k in range(60)]
    assert max(m["policy_lag/max"] for m in learner.logged) <= ahead
    order = {event: i for i, event in enumerate(learner.events)}
    for k in range(1, 60):
        assert order["critic_train", k - 1] < order["critic_values", k]
    timings = [m for m in learner.logged if "timing/critic_train_s" in m]
    assert len(timings) == 60 and all("timing/critic_values_s" in m for m in timings)


def test_weights_reach_the_engine_once_per_version_in_order(tmp_path):
    engine = TimedEngine()
    run_async(make_cfg(tmp_path, steps=5, ahead=1), engine, FakeLearner())
    updates = [kw["version"] for name, kw in engine.calls if name == "update_weights"]
    assert updates == ["v1", "v2", "v3", "v4", "v5"]
    assert engine.weights["model.weight"].item() == 5.0


@pytest.mark.parametrize("pause", ["retract", "in_place"])
def test_in_flight_loads_pause_generation_and_mix_versions(tmp_path, pause):
    engine = TimedEngine(token_s=0.004)
    learner = FakeLearner(lambda stage, step: 0.02 if stage == "train" else 0.0)
    cfg = make_cfg(tmp_path, steps=8, ahead=1, mode="in_flight", max_new_tokens=12, pause=pause)
    gen_clock, _ = run_async(cfg, engine, learner)
    assert max(m["policy_lag/max"] for m in learner.logged) <= 1
    assert sum(m["policy_lag/mixed_samples"] for m in learner.logged) > 0
    paused = [e for e in gen_clock.trace.events() if e.get("name") == "generate (paused)"]
    pauses = [kw for name, kw in engine.calls if name == "pause"]
    assert pauses and all(kw["mode"] == pause for kw in pauses)
    assert len(paused) == len(pauses), "every in-flight pause is a PAUSED span of generate"
    flushes = [i for i, (name, _) in enumerate(engine.calls) if name == "flush_cache"]
    if pause == "in_place":
        assert flushes, "in-place loads leave KV to flush before the next batch"
    else:  # retract: every load flushes as it lands; nothing is left for later
        assert not flushes
        finals = [kw for name, kw in engine.calls if name == "update_weights"]
        assert finals and all(kw["flush_cache"] for kw in finals)


@pytest.mark.parametrize("pause", ["retract", "in_place"])
def test_in_flight_stress_twenty_runs_without_a_failure(tmp_path, pause):
    for run in range(20):
        engine = TimedEngine(token_s=0.001)
        rng = random.Random(run)
        learner = FakeLearner(lambda stage, step, rng=rng: rng.choice([0.0, 0.002, 0.005]))
        (tmp_path / str(run)).mkdir()
        cfg = make_cfg(tmp_path / str(run), steps=6, ahead=2, mode="in_flight",
                       validation_every=2, max_new_tokens=6, pause=pause)  # fmt: skip
        run_async(cfg, engine, learner)
        assert len(learner.logged) == 6


def test_a_stuck_stage_is_reported_as_the_most_upstream_cause(tmp_path):
    # The learner hangs in its first train step: no new weights come. On the engine host,
    # reward waits for rollouts (a symptom, it started waiting first) and generate waits for
    # the weights its next step needs (the cause): the error names generate and its wait.
    learner = FakeLearner(lambda stage, step: 2.5 if (stage, step) == ("train", 0) else 0.0)
    cfg = make_cfg(tmp_path, steps=5, ahead=1, timeout_s=1.0)
    errors = {}
    run_async(cfg, TimedEngine(), learner, errors=errors)
    gen_error = errors["generate"]
    assert isinstance(gen_error, StageTimeout), gen_error
    assert gen_error.context["stage"] == "generate"
    assert gen_error.waiting_for == "engine weights v1 (engine serves v0)"
    if "symptom" in gen_error.context:  # another wait timed out first: it is named, as such
        assert gen_error.context["symptom"].startswith(
            ("stage reward waited for an item in queue rollouts",
             "stage dataloader waited for space in queue prompts")
        )  # fmt: skip


def test_a_downstream_wait_that_times_out_first_reports_the_upstream_guard():
    # `source` works 0.3 s on item 1, then waits on its guard; `sink` has waited for items
    # since item 0, so it times out first, but the cause reported is the guard upstream.
    from megatron_async_rl.scheduler.machine import StageMachine
    from megatron_async_rl.scheduler.queues import BoundedQueue
    from megatron_async_rl.scheduler.scheduler import Scheduler, StageTask
    from megatron_async_rl.scheduler.states import Stage

    items = BoundedQueue("rollouts", 4)

    def work(index):
        if index == 1:
            threading.Event().wait(0.3)
        return None if index == 1 else index

    tasks = [
        StageTask(StageMachine(Stage.GENERATE), work, output=items, num_items=3,
                  guard=lambda _: "engine weights v1" if source.produced >= 2 else None),
        StageTask(StageMachine(Stage.REWARD), lambda item: None, inputs=items),
    ]  # fmt: skip
    source = tasks[0]
    with pytest.raises(StageTimeout) as caught:
        Scheduler(tasks, role="generate", rank=1, timeout_s=0.5).run()
    error = caught.value
    assert error.context["stage"] == "generate" and error.waiting_for == "engine weights v1"
    assert error.waited_s < 0.5 and "stage reward waited" in error.context["symptom"]


def test_exact_validation_evaluates_every_due_version_before_the_next_load(tmp_path):
    engine = TimedEngine()
    learner = FakeLearner(lambda stage, step: 0.002)
    cfg = make_cfg(tmp_path, steps=7, ahead=2, validation_every=2)
    run_async(cfg, engine, learner)
    evaluated = [m["val/version"] for m in learner.logged if "val/version" in m]
    assert evaluated == [0, 2, 4, 6]
    # each validation request ran on exactly its due version, and no load passed a due version
    # before its validation: walk the engine's calls in order
    loaded, validated = 0, set()
    for name, kw in engine.calls:
        if name == "update_weights":
            new = int(kw["version"].lstrip("v"))
            assert new - 1 not in (0, 2, 4, 6) or new - 1 in validated, f"v{new} passed v{new - 1}"
            loaded = new
        if name == "generate" and kw["rids"][0].startswith("s"):
            step = int(kw["rids"][0][1:].split("-")[0])
            if step >= SEED_STEP_OFFSET:
                assert step - SEED_STEP_OFFSET == loaded, "validated another version"
                validated.add(loaded)
    assert validated == {0, 2, 4, 6}


def test_latest_validation_never_holds_a_load_back(tmp_path):
    learner = FakeLearner()
    cfg = make_cfg(tmp_path, steps=6, ahead=2, validation_every=2, validation_version="latest")
    run_async(cfg, TimedEngine(), learner)
    evaluated = [m["val/version"] for m in learner.logged if "val/version" in m]
    assert evaluated and all(v >= due for v, due in zip(evaluated, [0, 2, 4]))


def test_timings_utilization_and_trace_are_views_of_the_same_spans(tmp_path):
    learner = FakeLearner(lambda stage, step: 0.003)
    roles = ("train", "logp", "ref")  # the fake learner's rank runs all three roles' work
    clocks = (RankClock(1, ("generate",)), RankClock(0, roles))
    run_async(make_cfg(tmp_path, steps=4, ahead=1), TimedEngine(token_s=0.001), learner, clocks)
    events = [e for e in clocks[1].trace.events() if e.get("ph") == "X"]
    for metrics in learner.logged:
        step = metrics["step"]
        for name in ("logp", "ref", "train", "weight_sync"):
            spans = [
                e["dur"] / 1e6 for e in events if e["name"] == name and e["args"]["step"] == step
            ]
            assert metrics[f"timing/{name}_s"] == pytest.approx(sum(spans), abs=1e-6)
    # utilization windows tile the run: their busy seconds add up to the union of the spans
    spans = clocks[1].trace.spans()
    union = busy_idle(spans, 0.0, max(s["end_s"] for s in spans) + 1, {0: roles})
    total = sum(m["utilization/train+logp+ref/busy_s"] for m in learner.logged)
    assert total == pytest.approx(union["utilization/train+logp+ref/busy_s"], abs=1e-5)


def test_a_rank_is_busy_only_in_the_stages_of_its_own_roles(tmp_path):
    """A critic rank runs every learn stage; logp, ref and train (the batch's layout, the train
    stage's gather and GAE) are not its busy time, critic_values and critic_train are."""
    learner = FakeLearner(lambda stage, step: 0.01)
    cfg = make_cfg(tmp_path, steps=3, ahead=1, roles=("train", "logp", "ref", "critic",
                                                      "generate"))  # fmt: skip
    clocks = (RankClock(1, ("generate",)), RankClock(0, ("critic",)))
    run_async(cfg, TimedEngine(token_s=0.001), learner, clocks)
    spans = clocks[1].trace.spans()
    end = max(s["end_s"] for s in spans) + 1
    own = [s for s in spans if s["stage"] in ("critic_values", "critic_train", "weight_sync")]
    want = busy_idle(own, 0.0, end, {0: ("critic",)})["utilization/critic/busy_s"]
    every = busy_idle(spans, 0.0, end, {0: ("critic",)})["utilization/critic/busy_s"]
    total = sum(m["utilization/critic/busy_s"] for m in learner.logged)
    assert total == pytest.approx(want, abs=1e-5)
    assert every > want + 0.05  # logp, ref and train slept 10 ms a step each


class WaitingExchange(LocalExchange):
    """The other ranks reach each weight sync `wait_s` later (rank 0 still training)."""

    wait_s = 0.05

    def weights_ready(self):
        threading.Event().wait(self.wait_s)


def test_a_rank_waiting_for_the_weight_sync_is_idle_not_busy(tmp_path):
    cfg = make_cfg(tmp_path, steps=3, ahead=0)
    learner = FakeLearner()
    clock = RankClock(0, ("generate", "train"))
    run_steps(make_generate_side(cfg, TimedEngine()), learner, WaitingExchange(learner.state),
              clock, cfg)  # fmt: skip
    syncs = [m["timing/weight_sync_s"] for m in learner.logged]
    assert len(syncs) == 3 and max(syncs) < WaitingExchange.wait_s / 2
    busy = [m["utilization/generate+train/busy_s"] for m in learner.logged]
    windows = [m["utilization/generate+train/busy_s"] + m["utilization/generate+train/idle_s"]
               for m in learner.logged]  # fmt: skip
    assert all(w - b >= WaitingExchange.wait_s * 0.9 for b, w in zip(busy, windows))
