"""megatron_async_rl: asynchronous RL for LLMs on Megatron-core roles and SGLang engines."""

__version__ = "0.1.0"
