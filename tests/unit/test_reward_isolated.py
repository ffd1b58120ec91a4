"""`processes.isolated.IsolatedReward` behind `SafeReward` (`reward.call_timeout_s`).

Contract checked, with a real child process (nothing faked): a reward plug-in answers through
the pipe; a call that hangs is cut after `call_timeout_s`, scores 0 and is counted in
`reward/timeouts`, its process is killed, and the next call is answered by a new one; an
exception in the reward scores 0 (its type and message logged); a reward process that dies
(`os._exit`) scores 0 and the next call starts a new one; `reward.call_timeout_s` is checked;
with `reward.on_failure: stop` a failure raises, naming the reward and the sample.
"""

from __future__ import annotations

import logging
import time

import psutil
import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.rewards.config import RewardConfig
from megatron_async_rl.rewards.registry import safe_reward

PLUGIN = """
import os, time

def score(response_text, answer, metadata):
    if response_text == "hang":
        time.sleep(3600)
    if response_text == "raise":
        raise KeyError("no such field")
    if response_text == "die":
        os._exit(7)
    return 1.0 if response_text == answer else 0.0
"""


def test_a_hanging_reward_is_cut_counted_and_the_next_call_answered(tmp_path, monkeypatch,
                                                                     caplog):  # fmt: skip
    (tmp_path / "hang_reward_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    safe = safe_reward(RewardConfig(name="hang_reward_plugin:score", call_timeout_s=1.0))
    try:
        assert safe("7", "7", {}) == 1.0
        first = safe.fn._proc.pid
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert safe("hang", "7", {}, uid="s1") == 0.0
        assert 1.0 <= time.monotonic() - start < 5
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie"
        assert "did not answer within reward.call_timeout_s = 1 s" in caplog.text
        assert safe("7", "7", {}) == 1.0 and safe.fn._proc.pid != first
        with caplog.at_level(logging.WARNING):
            assert safe("raise", "7", {}, uid="s3") == 0.0
        assert "KeyError" in caplog.text and "no such field" in caplog.text
        assert safe("die", "7", {}, uid="s4") == 0.0
        assert safe("0", "0", {}) == 1.0
        assert safe.metrics() == {"reward/errors": 3.0, "reward/timeouts": 1.0,
                                  "reward/calls": 6.0}  # fmt: skip
    finally:
        safe.fn.close()


def test_call_timeout_is_checked():
    with pytest.raises(ConfigError, match=r"call_timeout_s = 0.*> 0"):
        RewardConfig(name="math", call_timeout_s=0)


def test_on_failure_stop_raises_naming_the_reward_and_the_sample(tmp_path, monkeypatch):
    (tmp_path / "stop_reward_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    safe = safe_reward(RewardConfig(name="stop_reward_plugin:score", on_failure="stop"))
    assert safe("1", "1", {}) == 1.0
    with pytest.raises(RuntimeError, match=r"stop_reward_plugin:score failed on sample s9 and "
                       r"reward.on_failure is stop: KeyError"):  # fmt: skip
        safe("raise", "1", {}, uid="s9")
    with pytest.raises(ConfigError, match=r"on_failure = 'retry'"):
        RewardConfig(on_failure="retry")
