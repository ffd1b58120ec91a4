"""The asynchronous loop on two hosts: one torchrun agent per host, c10d rendezvous between them.

Two network namespaces (`hosts.TwoHosts`), each with its own hostname, address and /dev/shm,
stand for two machines. The tiny recipe's world is 2 ranks, one per host: train+logp+ref on
one, the SGLang engine (generate) on the other, so no engine spans hosts and every weight sync
crosses between them.

Contracts checked:
- the run completes on both agents (exit 0) with the asynchronous loop (`scheduler.loop:
  async`, N = 0, validation every 2 versions);
- weight sync picks the between-hosts transport: no sender offers shared memory across hosts
  (`weight_sync/shared_memory_senders` 0), where the same run on one host uses it (1); with
  `weight_sync.delta` on, every version is sent through the delta codec against the one
  before (the first against the start-up sync's), decoded and checked by the generate rank
  before its engine loads it;
- the run learns as on one host: every metric but timings, throughput, utilization and the
  transport equals the one-host synchronous run's (`sync_run` in tests/conftest.py, 4 optimizer
  mini-batch steps per RL step under an lr schedule) at every step, validation of versions 0
  and 2 included, and the save of version 2 (it waits for step 2's generation, never cuts it:
  tests/unit/test_async_checkpoint.py). This is the suite's end-to-end run of the asynchronous
  loop at N = 0 being the synchronous one (in one process with the fake engine:
  tests/unit/test_async_pipeline.py; with refill: tests/unit/test_refill_pipeline.py; with a
  critic and a reward model: tests/e2e/test_ppo_job.py).
Nothing is faked: real namespaces, torchrun, gloo over the veth pair, megatron-core, SGLang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cluster.hosts import CannotRun, TwoHosts
from tests.harness.ports import free_port
from tests.harness.recipes import RECIPE, REPO, SYNC_SETS

pytestmark = [pytest.mark.multihost, pytest.mark.slow, pytest.mark.e2e]
VOLATILE = ("timing/", "throughput/", "scheduler/", "utilization/", "weight_sync/GB_per_s",
            "weight_sync/stall_s", "weight_sync/shared_memory_senders", "checkpoint/",
            "weight_sync/delta", "weight_sync/full_syncs")  # fmt: skip


@pytest.fixture
def hosts():
    # another test session may run beside this one (scripts/test.sh): a tag of this process's
    for tag in (os.getpid() % 1000, (os.getpid() + 499) % 1000):
        try:
            two = TwoHosts(tag)
            break
        except CannotRun as why:
            reason = why
    else:
        pytest.skip(f"cannot build two hosts here: {reason}")
    yield two
    two.close()


def _stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_async_loop_on_two_hosts_learns_as_on_one(hosts, task, sync_run, tmp_path):
    run_dir = tmp_path / "run"
    sets = [*SYNC_SETS, f"validation.data.path={task.val}", "scheduler.loop=async",
            "weight_sync.delta=true",
            f"model.hf_path={task.model}", f"data.path={task.data}"]  # fmt: skip
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-id", "two-hosts", "--rdzv-backend", "c10d",
        # a port free on this machine; host 0's network namespace is new, nothing holds one there
        "--rdzv-endpoint", f"{hosts.addrs[0]}:{free_port()}",
        "-m", "megatron_async_rl.train", "--config", str(RECIPE), "--run-dir", str(run_dir),
    ]  # fmt: skip
    for item in sets:
        argv += ["--set", item]
    agents = []
    for host in (0, 1):
        env = dict(os.environ, GLOO_SOCKET_IFNAME=hosts.ifaces[host], OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO))  # fmt: skip
        log = open(tmp_path / f"host{host}.log", "w")
        agents.append((hosts.popen(host, argv, env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [proc.wait(timeout=600) for proc, _ in agents]
    finally:
        for proc, log in agents:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = [(tmp_path / f"host{h}.log").read_text() for h in (0, 1)]
    assert codes == [0, 0], "\n\n".join(log[-4000:] for log in logs)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(sync_run.rows) == 4
    # validation of versions 0 and 2 (every 2), reported with the step that follows it
    assert [r.get("val/version") for r in sync_run.rows] == [0.0, None, 2.0, None]
    assert all(0 <= r["utilization/bubble_ratio"] <= 1 for r in sync_run.rows + rows)
    assert all(r["weight_sync/shared_memory_senders"] == 1.0 for r in sync_run.rows)
    assert all(r["weight_sync/shared_memory_senders"] == 0.0 for r in rows)
    # the leader is the train rank, the sender: every version a delta, none failed
    assert all(r["weight_sync/delta_senders"] == 1.0 for r in rows), rows
    assert all(r["weight_sync/full_syncs"] == 0.0 for r in rows)
    assert all(r["weight_sync/delta_fallbacks"] == 0.0 for r in rows)
    # fp32 here: an Adam step moves every element, so each message goes whole (deltas of bf16
    # updates, a few percent of the bytes: tests/distributed/test_weight_sync_delta.py)
    assert all(0 < r["weight_sync/delta_fraction"] <= 1.01 for r in rows), rows
    for one, two in zip(sync_run.rows, rows, strict=True):
        assert _stable(one) == _stable(two), (
            one["step"], set(_stable(one).items()) ^ set(_stable(two).items()),
        )  # fmt: skip
