"""Where prompts come from: datasets and their cursor, generation, validation, tools and turns.

`config` holds the recipe's `data:`, `rollout:` and `validation:` sections; `dataset.PromptDataset`
feeds the dataloader stage; `generation` and `validation` call the engines. The demo tasks and
their warm starts live in `tasks/`. This package file imports nothing, so the recipe loader can
import `rollout.config` without numpy or a tokenizer; none of its modules imports megatron.
"""
