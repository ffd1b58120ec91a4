"""A peer that dies or hangs inside a gloo collective is reported within the bound, named.

Contract (issue 14, item 5): on 2 real gloo ranks, rank 0 runs the real `Scheduler` with a
`train` stage whose work is an `all_reduce` on a group made with a 6 s timeout (what
`ResolvedConfig.collective_timeout_s` derives from `scheduler.stage_timeout_s`), and rank 1
enters the collective never:
- rank 1 SIGKILLs itself: rank 0's run fails at once with `CollectiveFailure` naming role
  train, rank 0, stage train, `torch.distributed.all_reduce` and the line that called it;
- rank 1 SIGSTOPs itself (a hung peer): the step watchdog (scheduler timeout 2 s) reports the
  stall naming the collective the main thread is in, then the collective fails at the group's
  timeout (6 s, not torch's 30 min default) with the same naming.
Nothing is faked: real processes, real signals, real gloo.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.harness import ranks as harness

pytestmark = pytest.mark.slow  # ~20 s: two worlds of two ranks

GROUP_TIMEOUT_S = 6.0


def _world(rank, world_size, tmp_dir, fault):
    import torch
    import torch.distributed as dist

    from megatron_async_rl.scheduler.machine import StageMachine
    from megatron_async_rl.scheduler.scheduler import Scheduler, StageTask
    from megatron_async_rl.scheduler.states import Stage

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    group = dist.new_group([0, 1], backend="gloo", timeout=timeout)
    dist.barrier(group=group)
    if rank == 1:
        Path(tmp_dir, "victim.pid").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
        time.sleep(600)  # never reached: the test kills this rank
    reports: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            reports.append(record.getMessage())

    logging.getLogger("megatron_async_rl.scheduler.watchdog").addHandler(Collect())
    time.sleep(0.5)  # rank 1 is dead or stopped by now

    def reduce(_):
        dist.all_reduce(torch.ones(1), group=group)

    task = StageTask(StageMachine(Stage.TRAIN), reduce, num_items=1)
    scheduler = Scheduler([task], role="train", rank=0, timeout_s=2.0)
    start = time.monotonic()
    try:
        scheduler.run()
    except Exception as err:  # noqa: BLE001 - the result under test
        return {
            "type": type(err).__name__,
            "message": str(err),
            "cause": type(err.__cause__).__name__,
            "elapsed": time.monotonic() - start,
            "reports": reports,
        }
    return {"type": None, "reports": reports}


def _run(tmp_path, fault: str) -> dict:
    if harness.START_METHOD == "forkserver":
        mp.set_forkserver_preload(["tests.harness.rank_preload"])
    context = mp.start_processes(
        harness._entry,
        args=(2, str(tmp_path), _world, (fault,)),
        nprocs=2,
        start_method=harness.START_METHOD,
        join=False,
    )
    result_file = Path(harness._result_file(str(tmp_path), 0))
    deadline = time.monotonic() + 120
    while not result_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    victim = Path(tmp_path, "victim.pid")
    if victim.exists() and fault == "hang":
        os.kill(int(victim.read_text()), signal.SIGKILL)
    for process in context.processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    import torch

    status, result = torch.load(result_file, weights_only=False)
    assert status == "ok", result
    return result


def test_dead_peer_is_named_at_once(tmp_path):
    result = _run(tmp_path, "kill")
    assert result["type"] == "CollectiveFailure", result
    message = result["message"]
    assert "role train, rank 0, stage train" in message
    assert "collective torch.distributed.all_reduce" in message
    assert "in reduce at" in message and "test_collective_faults.py" in message
    assert result["elapsed"] < GROUP_TIMEOUT_S, result  # gloo sees the closed connection
    assert result["reports"] == []  # no stall: it failed before the watchdog's bound


def test_hung_peer_is_reported_by_the_watchdog_then_bounded(tmp_path):
    result = _run(tmp_path, "hang")
    assert result["type"] == "CollectiveFailure", result
    assert "collective torch.distributed.all_reduce" in result["message"]
    assert "Timed out" in result["message"] or "timed out" in result["message"].lower()
    # Bounded by the group's timeout (6 s), not torch's default of 30 minutes.
    assert GROUP_TIMEOUT_S - 0.5 < result["elapsed"] < GROUP_TIMEOUT_S + 10, result
    reports = result["reports"]
    assert reports, "the step watchdog reported nothing during a 6 s stall (bound 2 s)"
    assert "role train, rank 0: no stage made progress" in reports[0]
    assert "train RUNNING" in reports[0]
    assert "collective torch.distributed.all_reduce" in reports[0], reports[0]
