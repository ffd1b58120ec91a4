"""Where prompts come from: datasets and their cursor, the synthetic task, the warm start.

`dataset.PromptDataset` feeds the dataloader stage; `arithmetic` writes the quick start's task;
`warm_start` (its own process: it runs transformers) prepares the quick start's model. Importing
this package loads neither torch nor megatron.
"""

from megatron_async_rl.rollout.dataset import (
    DataCursor,
    DatasetConfig,
    PromptDataset,
    PromptRecord,
    encode_prompt,
)

__all__ = ["DataCursor", "DatasetConfig", "PromptDataset", "PromptRecord", "encode_prompt"]
