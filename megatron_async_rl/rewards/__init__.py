"""Reward functions, one per file, and the registry that finds them by name or module:function.

`config.RewardConfig` is the recipe's `reward:` section; `registry.get_reward(spec)` returns a
function `(response_text, answer, metadata) -> float`; `registry.SafeReward` is what the reward
stage calls. This package file imports nothing, so the recipe loader can import `rewards.config`
without the registry; nothing here imports torch or megatron.
"""
