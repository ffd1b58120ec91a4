"""Where prompts come from: datasets and their cursor, generation, validation, the synthetic task.

`config` holds the recipe's `data:`, `rollout:` and `validation:` sections; `dataset.PromptDataset`
feeds the dataloader stage; `generation` and `validation` call the engines; `arithmetic` writes
the quick start's task; `warm_start` (its own process: it runs transformers) prepares the quick
start's model. This package file imports nothing, so the recipe loader can import
`rollout.config` without numpy or a tokenizer; none of its modules imports megatron.
"""
