"""The learn side reports and warns about groups with nothing to learn from.

Contract: `data/zero_variance_groups` is the share of a step's GRPO groups whose samples all got
the same reward; above 0.75 the leader warns with the counts, at most once every 10 steps; other
ranks never do. Nothing is faked but the LearnSide instance (only the fields the method reads).
"""

import logging
from types import SimpleNamespace

import torch

from megatron_async_rl.roles.learn import LearnSide


def _side(is_leader=True):
    return SimpleNamespace(is_leader=is_leader, _quiet_until=0)


def test_share_and_rate_limited_warning(caplog):
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])  # groups of 2: 3 of 4 flat
    side = _side()
    caplog.set_level(logging.WARNING, logger="megatron_async_rl.roles.learn")
    assert LearnSide._zero_variance_share(side, rewards, 2, step=0) == 0.75
    assert not caplog.records  # 0.75 is not above the threshold
    flat = torch.ones(8)
    assert LearnSide._zero_variance_share(side, flat, 2, step=1) == 1.0
    assert LearnSide._zero_variance_share(side, flat, 2, step=5) == 1.0  # within 10 steps
    assert LearnSide._zero_variance_share(side, flat, 2, step=11) == 1.0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[0].startswith("step 1: 4 of 4 groups got one reward")
    caplog.clear()
    LearnSide._zero_variance_share(_side(is_leader=False), flat, 2, step=1)
    assert not caplog.records
