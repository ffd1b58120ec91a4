"""`engines.recovery.reassign.HelpBoard` and `RestartingEngine` with several engines: a dead
engine's requests are taken over by another while it restarts.

Contract checked, on real `torch.distributed` stores (`HashStore` in process, `TCPStore` over
loopback; nothing of the store is faked) and fake engines (`FakeEngine`; the real twin is
`scripts/engine_fault_soak.py --engines 2`, real SGLang engines on real ranks):
- a job is claimed once (the poster's take-back and a helper race for it), by a helper only
  when its engine serves a version inside the job's window, never by its own poster; results
  reach the poster and the job's keys are removed;
- engine A dies in the middle of a generate call; engine B's helper thread takes over A's
  unfinished requests (continued from A's prefixes) while A restarts: A's call returns B's
  tokens joined to its prefixes, counted on both sides; with no helper able to take them
  (its version too old, or its engine busy with its own batch the whole time: `help_gate`),
  A takes them back and generates them itself;
- the engine gate treats a taken-over batch as a batch (an in-flight load pauses it) without
  moving the generate stage's machine (faked: the machine, a recorder).
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist

from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_async_rl.engines.recovery.reassign import HelpBoard
from megatron_async_rl.engines.recovery.restarting import RestartingEngine
from megatron_async_rl.weight_sync.sinks import load_tensors


def _requests(tag="r", n=3, max_new_tokens=6):
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    return [GenerateRequest([1, 2 + i], sampling, f"{tag}{i}") for i in range(n)]


def test_a_job_is_claimed_once_inside_its_window_and_delivered():
    store = dist.HashStore()
    poster, helper, other = (HelpBoard(dist.PrefixStore("h", store), i) for i in range(3))
    job = poster.post(_requests(), oldest_version=2)
    assert poster.claim_next(5) is None  # never its own
    assert helper.claim_next(1) is None  # version 1 is older than the window's 2
    claimed = helper.claim_next(2)
    assert claimed is not None and claimed[0] == job and [r.rid for r in claimed[1]] == [
        "r0", "r1", "r2"]  # fmt: skip
    assert other.claim_next(5) is None and not poster.take_back(job)
    assert poster.owner(job) == 1
    helper.deliver(job, ["results"])
    assert poster.wait(job, timeout_s=5) == ["results"]
    assert not store.check([f"h/job/{job}"]) and not store.check([f"h/result/{job}"])
    second = poster.post(_requests("s"), oldest_version=None)
    assert poster.take_back(second) and helper.claim_next(9) is None
    assert helper._seen == second  # both taken: a later poll scans from the next job on


def test_the_board_works_over_tcp_too():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, 1, False,
                           timeout=datetime.timedelta(seconds=10))  # fmt: skip
    poster = HelpBoard(dist.PrefixStore("h", server), 0)
    helper = HelpBoard(dist.PrefixStore("h", client), 1)
    job = poster.post(_requests(), oldest_version=0)
    assert helper.claim_next(0)[0] == job
    helper.deliver(job, [1, 2])
    assert poster.wait(job, timeout_s=5) == [1, 2]


class Factory:
    def __init__(self, name):
        self.name, self.engines = name, []

    def __call__(self):
        self.engines.append(FakeEngine(name=f"{self.name}{len(self.engines)}"))
        return self.engines[-1]


def _pair(store, slow_restart_s=0.0):
    """Engines A and B on one board; A's restarts take `slow_restart_s`."""
    made = {}
    for index, name in enumerate("AB"):
        factory = Factory(name)
        start = factory
        if name == "A" and slow_restart_s:

            def start(factory=factory):
                if factory.engines:  # a restart, not the first start
                    threading.Event().wait(slow_restart_s)
                return factory()

        engine = RestartingEngine(start, load_tensors, where=f"engine {name}", max_restarts=3,
                                  window_steps=10, health_timeout_s=5, check_every_s=0,
                                  board=HelpBoard(dist.PrefixStore("h", store), index),
                                  help_every_s=0.05)  # fmt: skip
        engine.begin_weight_update()
        engine.update_weights([("w", torch.ones(2))], "v3")
        engine.end_weight_update(True)
        made[name] = (engine, factory)
    return made


def test_a_dead_engine_s_requests_are_taken_over_by_another_while_it_restarts():
    made = _pair(dist.HashStore(), slow_restart_s=1.0)
    (a, a_made), (b, b_made) = made["A"], made["B"]
    try:
        a.set_step(3, oldest_version=2)
        a_made.engines[0].die_in_generate_after(2)
        results = a.generate(_requests())
        helper = b_made.engines[0]
        asked = [kw["rids"] for method, kw in helper.calls if method == "generate"]
        assert asked == [["r0", "r1", "r2"]]  # B generated A's rest
        prompt_prefix = [1, 2]
        head = [a_made.engines[0].token(prompt_prefix, p, "v3") for p in range(2)]
        tail = [helper.token(prompt_prefix + head, p, "v3") for p in range(4)]
        assert results[0].output_ids == head + tail
        assert "generate" not in a_made.engines[1].methods_called()  # A's new engine: none
        ma, mb = a.take_metrics(), b.take_metrics()
        assert ma["engines/requests_reassigned"] == 3 and ma["engines/tokens_kept"] == 6
        assert mb["engines/requests_taken_over"] == 3
    finally:
        a.shutdown()
        b.shutdown()


def test_requests_nobody_can_take_are_taken_back_by_the_restarted_engine():
    made = _pair(dist.HashStore())
    (a, a_made), (b, b_made) = made["A"], made["B"]
    try:
        a.set_step(5, oldest_version=4)  # B serves v3: too old for step 5's window
        a_made.engines[0].die_in_generate_after(2)
        results = a.generate(_requests())
        assert all(len(r.output_ids) == 6 for r in results)
        assert "generate" in a_made.engines[1].methods_called()
        assert "generate" not in b_made.engines[0].methods_called()
        assert "engines/requests_reassigned" not in a.take_metrics()
    finally:
        a.shutdown()
        b.shutdown()


def test_a_helper_busy_with_its_own_generation_claims_nothing():
    """B's gate is held (its own batch runs) for the whole time A restarts: B never claims A's
    job, so A takes it back instead of waiting for B."""
    made = _pair(dist.HashStore(), slow_restart_s=0.5)
    (a, a_made), (b, b_made) = made["A"], made["B"]
    busy = threading.Lock()
    b.help_gate = lambda: busy
    try:
        with busy:
            a.set_step(3, oldest_version=2)
            a_made.engines[0].die_in_generate_after(2)
            results = a.generate(_requests())
        assert all(len(r.output_ids) == 6 for r in results)
        assert "generate" in a_made.engines[1].methods_called()
        assert "generate" not in b_made.engines[0].methods_called()
    finally:
        a.shutdown()
        b.shutdown()


def test_a_load_pauses_a_taken_over_batch_without_touching_the_stage_machine():
    """`EngineGate.generating(stage=False)`: an in-flight load pauses the engine for a batch
    taken over from another engine, but the generate stage's machine (not running it) is left
    alone; the stage's own batch moves it as before."""
    from megatron_async_rl.jobs.weight_thread import EngineGate

    class Machine:  # records transitions (the real StageMachine runs in test_async_pipeline)
        def __init__(self):
            self.moves = []

        def transition(self, state, why):
            self.moves.append(state.value)

    engine, machine = FakeEngine(), Machine()
    gate = EngineGate(engine, machine, in_flight=True)
    tensors = {"w": torch.ones(2)}
    with gate.generating(stage=False):
        gate.load(tensors, 1, started=lambda: None)
    assert machine.moves == [] and ("pause", {"mode": "retract"}) in engine.calls
    with gate.generating():
        gate.load(tensors, 2, started=lambda: None)
    assert machine.moves == ["paused", "running"]
