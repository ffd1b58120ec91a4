"""The demo tasks of the quick starts, and the warm starts that prepare their models.

`arithmetic` writes the quick start's `a+b=` task and `arithmetic_reward` scores it (registered
as the `arithmetic` reward); `calculator` writes the multi-turn task and holds its tools
(`tasks.calculator:add`, `:price`); `warm_start` and `tool_warm_start` (each its own process: they
run transformers) teach a tiny model the answer format before RL. Above `rollout/` and `rewards/`,
whose datasets, turns and registry they use; nothing in the trainer imports them.
"""
