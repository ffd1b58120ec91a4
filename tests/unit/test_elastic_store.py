"""`platform.elastic_store`: under torchrun each restart attempt keys its own rendezvous.

torchrun's static rendezvous keeps its agent's store across `--max-restarts` restarts and
torch adds no per-attempt prefix, so a restarted world read the dead world's gloo addresses
("connection refused"). Checked here on a real `TCPStore` server standing in for the agent's;
the restart itself runs in tests/e2e/test_checkpoint_resume.py (`MAX_RESTARTS=1`).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from megatron_async_rl.distributed.platform import elastic_store
from tests.harness.ports import free_port

TIMEOUT = datetime.timedelta(seconds=10)


def test_each_restart_attempt_sees_only_its_own_keys(monkeypatch):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=TIMEOUT,
                          wait_for_workers=False)  # fmt: skip
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = elastic_store(TIMEOUT)
    first.set("rank_0_address", "old")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = elastic_store(TIMEOUT)
    assert not second.check(["rank_0_address"])  # the dead world's key is not seen
    second.set("rank_0_address", "new")
    assert first.get("rank_0_address") == b"old" and second.get("rank_0_address") == b"new"
    assert agent.check(["megatron_async_rl/attempt_1/rank_0_address"])


def test_outside_torchrun_there_is_no_store_of_ours(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert elastic_store(TIMEOUT) is None
