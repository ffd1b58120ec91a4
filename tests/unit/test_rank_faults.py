"""`jobs.faults.RankFaults`: the recipe's weight-message, reward and rank faults.

Contract: the `faults:` keys are validated (lists of steps, `allow` required, a reward hang
refused without `reward.call_timeout_s`); `tamper` flips one payload byte of a due version's
first message once (the resend is clean) and only on the engine the version falls to;
`reward_fault` marks one call per due step; an injected reward raise scores 0 and is counted,
an injected hang is cut by the real isolated reward's timeout (a real child process);
`at_step` kills its process with SIGKILL on the launcher's first attempt only (a real fork).
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.engines.config import FaultsConfig
from megatron_async_rl.jobs.faults import RankFaults
from megatron_async_rl.rewards.config import RewardConfig
from megatron_async_rl.rewards.registry import safe_reward
from megatron_async_rl.weight_sync.plan import HEADER_BYTES


def test_fault_keys_are_checked():
    with pytest.raises(ConfigError, match="allow"):
        FaultsConfig(weight_corrupt_versions=[2])
    with pytest.raises(ConfigError, match="reward_raise_steps"):
        FaultsConfig(allow=True, reward_raise_steps=[-1])
    with pytest.raises(ConfigError, match="rank_kill_rank"):
        FaultsConfig(allow=True, rank_kill_steps=[3], rank_kill_rank=-1)
    cfg = FaultsConfig(allow=True, reward_hang_steps=[2])
    assert cfg.any() and not cfg.engine_faults()


def test_tamper_corrupts_a_due_version_once_on_its_engine():
    faults = RankFaults(FaultsConfig(allow=True, weight_corrupt_versions=[3, 4]), rank=1,
                        engine_index=1, num_engines=2)  # fmt: skip
    view = torch.zeros(HEADER_BYTES + 8, dtype=torch.uint8)
    faults.tamper(view, 4, 0)  # version 4 falls to engine 0
    assert int(view.sum()) == 0
    faults.tamper(view, 3, 0)
    assert view[HEADER_BYTES] == 0xFF and int(view.sum()) == 0xFF
    faults.tamper(view, 3, 0)  # the resend of version 3 arrives clean
    assert view[HEADER_BYTES] == 0xFF
    assert faults.take_metrics() == {"faults/injected/weight_corrupt": 1.0}


def test_reward_faults_are_marked_once_and_recovered():
    faults = RankFaults(FaultsConfig(allow=True, reward_raise_steps=[2]), rank=1, engine_index=0)
    assert faults.reward_fault(1) is None
    assert faults.reward_fault(2) == "raise" and faults.reward_fault(2) is None
    reward = safe_reward(RewardConfig(name="arithmetic"))
    samples = [SimpleNamespace(response_text="7", answer="7", metadata={}, uid=f"u{i}")
               for i in range(3)]  # fmt: skip
    assert reward.score(samples, fault="raise") == [0.0, 1.0, 1.0]
    assert reward.metrics()["reward/errors"] == 1
    isolated = safe_reward(RewardConfig(name="arithmetic", call_timeout_s=2.0))
    try:
        assert isolated.score(samples, fault="hang") == [0.0, 1.0, 1.0]
        assert isolated.metrics()["reward/timeouts"] == 1
    finally:
        isolated.fn.close()


@pytest.mark.parametrize("attempt", [0, 1])
def test_at_step_kills_the_rank_on_the_first_attempt_only(attempt):
    faults = RankFaults(FaultsConfig(allow=True, rank_kill_steps=[2], rank_kill_rank=0), rank=0,
                        attempt=attempt)  # fmt: skip
    pid = os.fork()
    if pid == 0:  # the rank
        faults.at_step(1)
        faults.at_step(2)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if attempt == 0:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    else:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_a_kill_in_load_due_before_a_resume_is_not_injected_again():
    from megatron_async_rl.engines.recovery.faults import EngineFaults

    signals = []
    engine = SimpleNamespace(signal_scheduler=signals.append)
    cfg = FaultsConfig(allow=True, engine_kill_in_load_steps=[4, 8])
    faults = EngineFaults(cfg, rank=1)
    faults.skip_before(6)  # the world restarted from the version-6 checkpoint
    faults("load", 7, engine)
    assert signals == []
    faults("load", 8, engine)
    assert signals == [signal.SIGKILL]
