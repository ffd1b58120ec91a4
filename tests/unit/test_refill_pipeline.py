"""Refill in both loops, in one process: every training batch holds exactly the configured
number of informative groups.

Contracts checked:
- the synchronous loop (`jobs/grpo_sync.run_steps`) and the asynchronous pipeline at N = 0, 1
  and 2 (`GeneratePipeline` / `run_learn_pipeline` on a `LocalExchange`) with
  `algorithm.refill`: each step's batch has `rollout.num_prompts_per_step` groups, all
  informative (rewards that differ), numbered 0..P-1; steps needed refill rounds;
- at N = 0 the asynchronous pipeline logs exactly what the synchronous loop logs, the
  `dynamic_sampling/*` counts and each batch's prompts included;
- at N = 1 every generate call, for a kept group or a dropped one, starts on engine weights
  within its step's window (v >= s - N: admission counts every round), the trained tokens' lag
  stays within N, and generation runs ahead;
- short after `max_refill_rounds`: `pad` trains batches of P groups padded with zero-variance
  ones (counted), `error` stops the run with an error naming the knob;
- two engine hosts, each its own asynchronous pipeline (N = 0 and 1), agree on every round
  through a real `HashStore` (`StoreRounds`): each batch exact, their cursors equal, and the
  prompts trained those of one host in the synchronous loop;
- a run preempted while a step is between refill rounds (or generating one) resumes from the
  save and trains every step on exactly the prompts an uninterrupted run trains (checkpoints:
  `SyncCheckpoints` of tests/unit/test_async_checkpoint.py, its saved dicts in memory).
Faked: the engine (`TimedEngine`), the learner (`FakeLearner`: it counts each batch's groups and
informative groups) and the reward (`ScriptedReward`: the test chooses the informative
prompts), see `pipeline_fakes.py`; with two hosts, the learn side's exchange (`TwoHosts`: two
`LocalExchange`s merged); the loops, generate side, dataset, plan and scheduler are the
package's own.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch.distributed as dist

from megatron_async_rl.checkpoint.config import Preempted
from megatron_async_rl.jobs.async_checkpoint import Resumed
from megatron_async_rl.jobs.exchange import LocalExchange, _learn_work
from megatron_async_rl.jobs.grpo_async import run_learn_pipeline
from megatron_async_rl.jobs.grpo_sync import run_steps
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.rollout.refill import StoreRounds
from tests.unit.pipeline_fakes import (
    FakeLearner,
    LedgerLearner,
    ScriptedReward,
    SyncCheckpoints,
    TimedEngine,
    every_third,
    make_cfg,
    make_generate_side,
    run_async,
    run_generate,
    stable,
)

PROMPTS = 3


def _exact_batches(logged: list[dict], steps: int) -> list[float]:
    """Assert every logged batch holds PROMPTS informative groups; the rounds per step."""
    assert [m["step"] for m in logged] == list(range(steps))
    for m in logged:
        assert m["batch/groups"] == m["batch/informative_groups"] == PROMPTS, m["step"]
        assert m["batch/prompt_indices"] == list(range(PROMPTS))
        assert m["dynamic_sampling/groups_kept"] == PROMPTS
        assert m["dynamic_sampling/groups_padded"] == 0
    rounds = [m["dynamic_sampling/rounds"] for m in logged]
    assert max(rounds) > 1, "no step needed a refill round: the test checks nothing"
    return rounds


def _sync(cfg, reward):
    learner = FakeLearner()
    gen = make_generate_side(cfg, TimedEngine(), reward)
    run_steps(gen, learner, LocalExchange(learner.state), RankClock(0, ("generate", "train")),
              cfg)  # fmt: skip
    return learner, gen


def test_every_synchronous_batch_holds_exactly_the_configured_informative_groups(tmp_path):
    cfg = make_cfg(tmp_path, steps=6, ahead=0, refill=True, prompts=PROMPTS)
    learner, gen = _sync(cfg, ScriptedReward(every_third))
    rounds = _exact_batches(learner.logged, 6)
    # every round drew PROMPTS prompts, one after the other in the data
    cursor = gen.dataset.cursor
    assert cursor.epoch * len(gen.dataset) + cursor.index == PROMPTS * sum(rounds)
    for m in learner.logged:
        sampled = m["dynamic_sampling/groups_sampled"]
        assert sampled == PROMPTS * m["dynamic_sampling/rounds"]
        assert sampled == (PROMPTS + m["dynamic_sampling/groups_dropped_zero_variance"]
                           + m["dynamic_sampling/groups_dropped_extra"])  # fmt: skip
        assert m["dynamic_sampling/extra_generation_frac"] == (sampled - PROMPTS) / PROMPTS


def test_zero_steps_ahead_with_refill_is_the_synchronous_loop_exactly(tmp_path):
    cfg = make_cfg(tmp_path, steps=6, ahead=0, refill=True, prompts=PROMPTS, validation_every=2)
    sync, _ = _sync(cfg, ScriptedReward(every_third))
    learner = FakeLearner()
    run_async(cfg, TimedEngine(), learner,
              gen=make_generate_side(cfg, TimedEngine(), ScriptedReward(every_third)))  # fmt: skip
    _exact_batches(learner.logged, 6)
    assert len(sync.logged) == len(learner.logged) == 6
    for want, got in zip(sync.logged, learner.logged):
        assert stable(got) == stable(want)


@pytest.mark.parametrize("ahead", [1, 2])
def test_every_asynchronous_batch_holds_exactly_the_informative_groups(tmp_path, ahead):
    rng = random.Random(ahead)
    table = {(s, k): rng.choice([0.0, 0.0, 0.002]) for s in ("logp", "ref", "train")
             for k in range(30)}  # fmt: skip
    learner = FakeLearner(lambda stage, step: table[stage, step])
    engine = TimedEngine(token_s=0.0005)
    cfg = make_cfg(tmp_path, steps=30, ahead=ahead, refill=True, prompts=PROMPTS,
                   mode="in_flight", max_new_tokens=3)  # fmt: skip
    run_async(cfg, engine, learner,
              gen=make_generate_side(cfg, engine, ScriptedReward(every_third)))  # fmt: skip
    _exact_batches(learner.logged, 30)
    lags = [m["policy_lag/max"] for m in learner.logged]
    assert max(lags) <= ahead and ahead in lags, lags
    # every generate call (each round, kept or dropped) started within its step's window
    loaded = 0
    for name, kw in engine.calls:
        if name == "update_weights":
            loaded = int(kw["version"].lstrip("v"))
        if name == "generate":
            step = int(kw["rids"][0][1:].split("-")[0])
            assert loaded >= step - ahead, f"step {step} generated on v{loaded}"


def test_short_after_the_last_round_pads_the_batch_with_zero_variance_groups(tmp_path):
    cfg = make_cfg(tmp_path, steps=3, ahead=1, refill=True, prompts=PROMPTS, max_refill_rounds=2)
    learner = FakeLearner()
    engine = TimedEngine()
    run_async(cfg, engine, learner,
              gen=make_generate_side(cfg, engine, ScriptedReward(lambda uid: False)))  # fmt: skip
    for m in learner.logged:
        assert m["batch/groups"] == PROMPTS and m["batch/informative_groups"] == 0
        assert m["dynamic_sampling/groups_padded"] == PROMPTS
        assert m["dynamic_sampling/rounds"] == 3
        assert m["dynamic_sampling/groups_dropped_zero_variance"] == 2 * PROMPTS
    assert len(learner.logged) == 3


def test_short_after_the_last_round_with_error_stops_the_run_naming_the_knob(tmp_path):
    cfg = make_cfg(tmp_path, steps=3, ahead=1, refill=True, prompts=PROMPTS, max_refill_rounds=1,
                   refill_exhausted="error", timeout_s=2.0)  # fmt: skip
    errors = {}
    engine = TimedEngine()
    run_async(cfg, engine, FakeLearner(), errors=errors,
              gen=make_generate_side(cfg, engine, ScriptedReward(lambda uid: False)))  # fmt: skip
    assert "algorithm.max_refill_rounds = 1" in str(errors["generate"])


def _run_with_checkpoints(cfg, learner, engine, checkpoints, start=0, resumed=None, cursor=None):
    """`test_async_checkpoint._run` with the scripted reward: {side: error}."""
    gen = make_generate_side(cfg, engine, ScriptedReward(every_third))
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
def test_a_run_preempted_between_refill_rounds_resumes_on_the_same_prompts(tmp_path, mode):
    # A train step lasts about 2.5 rounds of generation (0.08 s each): every save lands while
    # a step is in its refill rounds, generating one (cut: its prefixes saved with the plan and
    # the groups kept so far). The resumed run trains every step on exactly the prompts of an
    # uninterrupted run, each batch exactly PROMPTS informative groups.
    steps, stop = 6, 3
    cfg = make_cfg(tmp_path, steps=steps, ahead=1, mode=mode, refill=True, prompts=PROMPTS,
                   max_new_tokens=8)  # fmt: skip
    engine = lambda: TimedEngine(token_s=0.01)  # noqa: E731
    train_s = lambda stage, step: 0.2 if stage == "train" else 0.0  # noqa: E731
    reference = LedgerLearner()
    assert _run_with_checkpoints(cfg, reference, engine(), SyncCheckpoints(steps)) == {}

    first = LedgerLearner(durations=train_s)
    checkpoints = SyncCheckpoints(steps, due=(1, 2), stop_at=stop)
    errors = _run_with_checkpoints(cfg, first, engine(), checkpoints)
    assert all(isinstance(e, Preempted) for e in errors.values()) and len(errors) == 2, errors
    refilling = [
        entry for version in (1, 2, stop)
        for entry in checkpoints.saved[version]["gen"]["pending"]["steps"]
        if entry["work"]["refill"]["rounds"] > 0 and not entry["work"]["refill"]["done"]
    ]  # fmt: skip
    assert refilling, "no save found a step between refill rounds: the test checks nothing"
    saved = checkpoints.saved[stop]["gen"]
    second = LedgerLearner(trained=stop, durations=train_s)
    resumed_engine = engine()
    LocalExchange(second.state).sync_weights(stop, resumed_engine)
    resumed = Resumed(saved["pending"], saved["validated"], saved["validations"], {})
    assert _run_with_checkpoints(cfg, second, resumed_engine, SyncCheckpoints(steps), stop,
                                 resumed, saved["cursor"]) == {}  # fmt: skip
    trained = {**first.ledger, **second.ledger}
    assert sorted(trained) == list(range(steps))
    for step in range(steps):
        assert trained[step][0] == reference.ledger[step][0], step  # the same prompts, once
        assert all(step - 1 <= v <= step for v in trained[step][1]), (step, trained[step][1])
    for m in first.logged + second.logged:
        assert m["batch/groups"] == m["batch/informative_groups"] == PROMPTS


class TwoHosts:
    """The learn side's exchange with two engine hosts, each on a `LocalExchange` of its own:
    a step's samples come from both (merged as the gloo exchange merges them), each version
    goes to both."""

    def __init__(self, state):
        self.hosts = [LocalExchange(state, timeout_s=60) for _ in range(2)]

    def receive_step(self, step):
        payloads = [host._samples.get(timeout=60) for host in self.hosts]
        return _learn_work(step, payloads)

    def sync_weights(self, version, engine=None):
        for host in self.hosts:
            host.sync_weights(version)
        return {}


@pytest.mark.parametrize("ahead", [0, 1])
def test_two_engine_hosts_agree_on_every_round_in_the_asynchronous_loop(tmp_path, ahead):
    steps = 8
    cfg = make_cfg(tmp_path, steps=steps, ahead=ahead, refill=True, prompts=PROMPTS,
                   mode="in_flight", max_new_tokens=3)  # fmt: skip
    learner = FakeLearner(lambda stage, step: 0.002)
    exchange, store = TwoHosts(learner.state), dist.HashStore()
    sides = [
        make_generate_side(cfg, TimedEngine(token_s=0.0005 * (1 + i)),
                           ScriptedReward(every_third), i, 2,
                           StoreRounds(dist.PrefixStore("refill", store), i, 2))
        for i in range(2)
    ]  # fmt: skip
    errors = {}

    def side(name, fn, *args):
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001 - re-raised by the test
            errors[name] = err

    threads = [
        threading.Thread(target=side, args=(
            f"generate {i}", run_generate, sides[i], exchange.hosts[i],
            RankClock(1 + i, ("generate",)), cfg, 1 + i,
        ))
        for i in range(2)
    ] + [threading.Thread(target=side, args=(
        "learn", run_learn_pipeline, learner, exchange, RankClock(0, ("train",)), cfg, 0, "train",
    ))]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a side never finished"
    assert not errors, errors
    _exact_batches(learner.logged, steps)
    assert sides[0].dataset.cursor == sides[1].dataset.cursor
    reference, _ = _sync(cfg, ScriptedReward(every_third))  # one host, the synchronous loop
    for got, want in zip(learner.logged, reference.logged):
        assert got["batch/uids"] == want["batch/uids"]
        for key in ("groups_sampled", "rounds", "groups_dropped_extra"):
            assert got[f"dynamic_sampling/{key}"] == want[f"dynamic_sampling/{key}"]
