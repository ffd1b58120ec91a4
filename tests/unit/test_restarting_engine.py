"""`engines.recovery.restarting.RestartingEngine` and `engines.recovery.health` over fake engines.

Contract checked: a call that finds the engine dead restarts it (a new engine from the factory)
and is carried on there; the new engine first gets the newest *complete* weight version with its
label (not an abandoned or half-loaded one), then the caller's pause and open weight session
(the tensors already loaded in it included), so a transfer that died half way completes; a
resubmitted generate is counted; past `max_restarts` within the window the run stops with an
error naming the engine, every cause and the counts; the budget's window slides over steps; a
hung engine is found by the watchdog (SUSPECT, then DEAD, killed) and the call blocked on it is
carried on by a new engine; illegal health moves are refused; the fake and the real engine
satisfy `RestartableEngine`, the restarting engine `ManagedEngine`. Faked: the engines
(`FakeEngine`); the real twin is `tests/distributed/test_engine_restart.py`.
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_async_rl.engines.recovery.health import (
    EngineHealth,
    EngineRestartLimitError,
    RestartBudget,
    transition,
)
from megatron_async_rl.engines.recovery.restarting import RestartingEngine
from megatron_async_rl.weight_sync.sinks import load_tensors


def _requests(n=3):
    sampling = SamplingParams(max_new_tokens=4)
    return [GenerateRequest([1, 2 + i], sampling, f"r{i}") for i in range(n)]


class Factory:
    def __init__(self):
        self.engines: list[FakeEngine] = []

    def __call__(self) -> FakeEngine:
        self.engines.append(FakeEngine(name=f"fake{len(self.engines)}"))
        return self.engines[-1]


def _engine(factory, max_restarts=3, window=10, check_every_s=0.0, timeout_s=1.0):
    return RestartingEngine(factory, load_tensors, where="generate rank 0",
                            max_restarts=max_restarts, window_steps=window,
                            health_timeout_s=timeout_s, check_every_s=check_every_s)  # fmt: skip


def _sync(engine, version, tensors):
    engine.begin_weight_update()
    engine.update_weights(list(tensors.items()), f"v{version}")
    engine.end_weight_update(True)


def test_a_dead_engine_is_restarted_with_the_newest_complete_weights_and_the_call_carried_on():
    factory = Factory()
    engine = _engine(factory)
    w1 = {"a": torch.ones(3), "b": torch.zeros(2)}
    _sync(engine, 1, w1)
    first = factory.engines[0]
    expected = first.generate(_requests())  # what v1 generates
    engine.generate(_requests())
    assert "engines/restart_resubmit_s" not in engine.take_metrics()  # no restart: no share
    # An abandoned session (half loaded: the engine is torn) is not what a restart reloads.
    engine.begin_weight_update()
    engine.update_weights([("a", torch.full((3,), 7.0))], "v1")
    engine.end_weight_update(False)
    first.die_at("generate")
    results = engine.generate(_requests())
    assert len(factory.engines) == 2
    new = factory.engines[1]
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]
    assert {r.token_versions[0] for r in results} == {"v1"}
    assert torch.equal(new.get_weights_by_name("a"), w1["a"])
    assert new.weight_version() == "v1"
    metrics = engine.take_metrics()
    assert metrics["engines/restarts"] == 1 and metrics["engines/requests_resubmitted"] == 3
    assert metrics["engines/healthy"] == 1.0 and metrics["engines/restart_s"] > 0
    assert engine.take_metrics() == {"engines/healthy": 1.0}


def test_a_transfer_that_died_half_way_goes_on_in_the_new_engine():
    factory = Factory()
    engine = _engine(factory)
    _sync(engine, 1, {"a": torch.ones(2), "b": torch.ones(2)})
    engine.pause("in_place")
    engine.begin_weight_update()
    engine.update_weights([("a", torch.full((2,), 2.0))], "v1", flush_cache=False)
    factory.engines[0].die_at("update_weights")
    engine.update_weights([("b", torch.full((2,), 3.0))], "v2", flush_cache=False)
    engine.end_weight_update(True)
    engine.resume()
    new = factory.engines[1]
    methods = new.methods_called()
    # reload v1 (its own session), pause again, reopen the session, reload "a", carry on "b"
    assert methods.index("pause") > methods.index("end_weight_update")
    assert new.paused is None and new.weight_version() == "v2"
    assert torch.equal(new.get_weights_by_name("a"), torch.full((2,), 2.0))
    assert torch.equal(new.get_weights_by_name("b"), torch.full((2,), 3.0))
    # and v2 is now the version a later restart reloads
    new.die_at("weight_version")
    assert engine.weight_version() == "v2"
    assert torch.equal(factory.engines[2].get_weights_by_name("b"), torch.full((2,), 3.0))


def test_a_death_when_ending_a_session_keeps_the_new_version_s_label():
    """All of v2 loaded, its last call stamped "v2"; the engine dies in end_weight_update: the
    new engine serves v2's weights as "v2" (not under v1's label)."""
    factory = Factory()
    engine = _engine(factory)
    _sync(engine, 1, {"a": torch.ones(2)})
    engine.begin_weight_update()
    engine.update_weights([("a", torch.full((2,), 2.0))], "v1", flush_cache=False)
    engine.update_weights([], "v2")
    factory.engines[0].die_at("end_weight_update")
    engine.end_weight_update(True)
    new = factory.engines[1]
    assert new.weight_version() == "v2"
    assert torch.equal(new.get_weights_by_name("a"), torch.full((2,), 2.0))
    assert {v for r in engine.generate(_requests(1)) for v in r.token_versions} == {"v2"}


def test_after_a_version_failed_on_every_attempt_the_engine_serves_the_last_one_again():
    """Item 4 of issue 14: a torn engine (an abandoned, half-loaded v2) reloads v1 in place;
    with no version kept yet (only the checkpoint's), it is restarted instead."""
    factory = Factory()
    engine = _engine(factory)
    w1 = {"a": torch.ones(3), "b": torch.zeros(2)}
    _sync(engine, 1, w1)
    expected = factory.engines[0].generate(_requests())
    engine.begin_weight_update()
    engine.update_weights([("a", torch.full((3,), 7.0))], "v2")
    engine.end_weight_update(False)
    engine.restore_last_version()
    assert len(factory.engines) == 1  # reloaded in place, no restart
    assert torch.equal(engine.get_weights_by_name("a"), w1["a"])
    assert engine.weight_version() == "v1"
    assert [r.output_ids for r in engine.generate(_requests())] == [r.output_ids for r in expected]
    fresh = _engine(Factory())
    fresh.begin_weight_update()
    fresh.update_weights([("a", torch.full((3,), 7.0))], "v1")
    fresh.end_weight_update(False)
    fresh.restore_last_version()
    assert fresh.take_metrics()["engines/restarts"] == 1


def test_past_max_restarts_in_the_window_the_run_stops_naming_every_cause():
    factory = Factory()
    engine = _engine(factory, max_restarts=2, window=5)
    for step in (1, 2):
        engine.set_step(step)
        factory.engines[-1].die_at("generate", f"scheduler killed {step}")
        engine.generate(_requests(1))
    engine.set_step(3)
    factory.engines[-1].die_at("generate", "scheduler killed 3")
    with pytest.raises(EngineRestartLimitError, match=r"generate rank 0.*3 time\(s\).*"
                       r"engine.max_restarts = 2.*step 1: generate: .*scheduler killed 1.*"
                       r"step 3: .*scheduler killed 3"):  # fmt: skip
        engine.generate(_requests(1))
    assert engine.state == EngineHealth.DEAD and len(factory.engines) == 3


def test_with_no_restarts_allowed_a_death_is_raised_and_no_weights_are_kept():
    factory = Factory()
    engine = _engine(factory, max_restarts=0)
    _sync(engine, 1, {"a": torch.ones(2)})
    assert not engine._last
    factory.engines[0].die_at("generate", "gone")
    with pytest.raises(Exception, match="gone"):
        engine.generate(_requests(1))
    assert len(factory.engines) == 1


def test_the_budget_window_slides_over_steps():
    budget = RestartBudget("e", max_restarts=2, window_steps=10)
    budget.charge(0, "a")
    budget.charge(5, "b")
    budget.charge(10, "c")  # step 0 left the window
    with pytest.raises(EngineRestartLimitError, match="3 within the last 10"):
        budget.charge(12, "d")


def test_a_hung_engine_is_found_by_the_watchdog_and_the_blocked_call_carried_on():
    factory = Factory()
    engine = _engine(factory, check_every_s=0.05, timeout_s=0.1)
    factory.engines[0].hang()
    out = []
    thread = threading.Thread(target=lambda: out.append(engine.generate(_requests(2))))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and len(out[0]) == 2
    assert len(factory.engines) == 2 and engine.state == EngineHealth.HEALTHY
    assert factory.engines[0].methods_called().count("probe") >= 2
    engine.shutdown()


def test_a_hang_while_loading_weights_is_found_by_a_control_probe():
    """Paused and in a weight session, the engine answers no generate request: the watchdog
    asks for a scheduler round trip instead, finds the hang, and the blocked load goes on."""
    factory = Factory()
    engine = _engine(factory, check_every_s=0.05, timeout_s=0.1)
    _sync(engine, 1, {"a": torch.ones(2)})
    engine.pause("retract")
    engine.begin_weight_update()
    factory.engines[0].hang()
    thread = threading.Thread(
        target=lambda: engine.update_weights([("a", torch.full((2,), 5.0))], "v2")
    )
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and len(factory.engines) == 2
    engine.end_weight_update(True)
    engine.resume()
    probes = [kw for m, kw in factory.engines[0].calls if m == "probe"]
    assert probes and all(kw["control_only"] for kw in probes)
    assert factory.engines[1].weight_version() == "v2" and factory.engines[1].paused is None
    assert torch.equal(factory.engines[1].get_weights_by_name("a"), torch.full((2,), 5.0))
    engine.shutdown()


def test_illegal_health_moves_are_refused():
    with pytest.raises(RuntimeError, match=r"illegal health transition healthy -> stale \(x\)"):
        transition("e", EngineHealth.HEALTHY, EngineHealth.STALE, "x")


# -- fault injection (`engines.recovery.faults`) ------------------------------------------


def test_faults_are_refused_without_allow_and_checked():
    from megatron_async_rl.config.errors import ConfigError
    from megatron_async_rl.engines.config import FaultsConfig

    with pytest.raises(ConfigError, match=r"allow.*False.*must be true.*faults.allow: true"):
        FaultsConfig(engine_kill_steps=[3])
    with pytest.raises(ConfigError, match=r"engine_hang_steps.*list of step numbers"):
        FaultsConfig(allow=True, engine_hang_steps=[1, -2])
    with pytest.raises(ConfigError, match=r"engine_kill_probability"):
        FaultsConfig(allow=True, engine_kill_probability=1.5)
    assert not FaultsConfig().any() and FaultsConfig(allow=True, engine_hang_steps=[0]).any()


def test_injected_kills_land_once_per_step_and_the_engine_recovers():
    from megatron_async_rl.engines.config import FaultsConfig
    from megatron_async_rl.engines.recovery.faults import EngineFaults

    cfg = FaultsConfig(allow=True, engine_kill_steps=[1], engine_kill_in_load_steps=[2],
                       delay_s=0.0)  # fmt: skip
    factory = Factory()
    engine = RestartingEngine(factory, load_tensors, where="g", max_restarts=5, window_steps=10,
                              health_timeout_s=1.0, check_every_s=0.0,
                              faults=EngineFaults(cfg, rank=1))  # fmt: skip
    for step in range(4):
        engine.set_step(step)
        assert len(engine.generate(_requests(2))) == 2
        _sync(engine, step + 1, {"a": torch.full((2,), float(step))})
    metrics = engine.take_metrics()
    assert metrics["faults/injected/engine_kill"] == 1
    assert metrics["faults/injected/engine_kill_in_load"] == 1
    assert metrics["engines/restarts"] == 2 and len(factory.engines) == 3
    assert factory.engines[-1].weight_version() == "v4"
    assert torch.equal(factory.engines[-1].get_weights_by_name("a"), torch.full((2,), 3.0))


def test_with_several_engines_a_step_s_fault_goes_to_one_engine():
    from megatron_async_rl.engines.config import FaultsConfig
    from megatron_async_rl.engines.recovery.faults import EngineFaults

    cfg = FaultsConfig(allow=True, engine_kill_steps=[3, 4], engine_kill_in_load_steps=[5])
    engines = [FakeEngine(name=f"e{i}") for i in range(2)]
    faults = [EngineFaults(cfg, rank=i, engine_index=i, num_engines=2) for i in range(2)]
    for step in (3, 4):
        for fault, engine in zip(faults, engines, strict=True):
            fault("generate", step, engine)
    assert [f.take_metrics() for f in faults] == [{"faults/injected/engine_kill": 1.0}] * 2
    for fault, engine in zip(faults, engines, strict=True):
        fault("load", 6, engine)
    assert [f.take_metrics() for f in faults] == [{}, {"faults/injected/engine_kill_in_load": 1.0}]


def test_a_generation_cut_by_a_death_goes_on_from_each_request_s_prefix():
    factory = Factory()
    engine = _engine(factory)
    _sync(engine, 1, {"a": torch.ones(2)})
    requests = [GenerateRequest([1, 2 + i], SamplingParams(max_new_tokens=6), f"r{i}")
                for i in range(3)]  # fmt: skip
    first = factory.engines[0]
    first.eos_token_id = first.token([1, 3], 1, "v1")  # r1 stops at its 2nd token
    first.die_in_generate_after(3)
    engine.set_step(4, oldest_version=None)
    results = engine.generate(requests)
    new = factory.engines[1]
    asked = dict(new.calls)["generate"]["rids"]
    assert asked == ["r0", "r2"]  # r1 had finished before the death: kept whole
    for i, result in enumerate(results):
        prompt = [1, 2 + i]
        if i == 1:
            assert result.finish_reason == "stop" and len(result.output_ids) == 2
            continue
        head = [first.token(prompt, p, "v1") for p in range(3)]
        tail = [new.token(prompt + head, p, "v1") for p in range(3)]
        assert result.output_ids == head + tail and result.token_versions == ["v1"] * 6
        assert result.output_logprobs == [FakeEngine.logprob(t) for t in head + tail]
    metrics = engine.take_metrics()
    assert metrics["engines/tokens_kept"] == 3 + 2 + 3
    assert metrics["engines/requests_resubmitted"] == 2
    assert "engines/tokens_regenerated" not in metrics  # zero counters are left out
    assert metrics["engines/restart_resubmit_s"] > 0


def test_a_prefix_older_than_the_step_s_window_is_generated_again_and_counted():
    factory = Factory()
    engine = _engine(factory)
    _sync(engine, 2, {"a": torch.ones(2)})  # the prefixes carry "v2"
    factory.engines[0].die_in_generate_after(2)
    engine.set_step(4, oldest_version=3)
    results = engine.generate(_requests())
    new = factory.engines[1]
    assert [r.output_ids for r in results] == [r.output_ids for r in new.generate(_requests())]
    metrics = engine.take_metrics()
    assert metrics["engines/tokens_regenerated"] == 6 and "engines/tokens_kept" not in metrics
    assert metrics["engines/requests_resubmitted"] == 3


def test_the_fakes_and_the_real_engine_satisfy_the_recovery_protocols():
    """What the restarting engine needs of the engine it wraps (`RestartableEngine`) holds for
    the fake these tests restart and for the real engine (checked on its class: no process is
    started); what it offers (`ManagedEngine`) holds for it and not for a bare engine, which the
    generate side, the loop and the weight sink then drive without the restart calls."""
    from megatron_async_rl.engines.protocol import Engine, ManagedEngine, RestartableEngine
    from megatron_async_rl.engines.sglang.engine import SGLangEngine

    factory = Factory()
    engine = _engine(factory)
    assert isinstance(factory.engines[0], RestartableEngine)
    assert issubclass(SGLangEngine, RestartableEngine) and issubclass(SGLangEngine, Engine)
    assert isinstance(engine, ManagedEngine) and isinstance(engine.inner, RestartableEngine)
    assert not isinstance(FakeEngine(), ManagedEngine)
