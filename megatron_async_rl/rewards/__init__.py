"""Reward functions, one per file, and the registry that finds them by name or module:function.

`registry.get_reward(spec)` returns a function `(response_text, answer, metadata) -> float`;
`registry.SafeReward` is what the reward stage calls. Nothing here imports torch or megatron.
"""

from megatron_async_rl.rewards.registry import (
    RewardConfig,
    RewardRequest,
    SafeReward,
    get_reward,
    register,
    registered_names,
)

__all__ = [
    "RewardConfig",
    "RewardRequest",
    "SafeReward",
    "get_reward",
    "register",
    "registered_names",
]
