"""Generation engines behind one protocol: the real SGLang engine and a deterministic fake.

`protocol` holds the contract and records; `sglang_engine.SGLangEngine` hosts a real
`sglang.Engine` in a child process (sglang is imported only there); `fake.FakeEngine` is for
unit tests of the code around engines. `cpu_shims/` holds the import shims SGLang needs on CPU.
"""

from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import (
    INITIAL_VERSION,
    PAUSE_MODES,
    Engine,
    EngineDiedError,
    EngineTimeoutError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    SamplingParams,
    expand_version_spans,
)
from megatron_async_rl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig

__all__ = [
    "INITIAL_VERSION",
    "PAUSE_MODES",
    "Engine",
    "EngineDiedError",
    "EngineTimeoutError",
    "FakeEngine",
    "GenerateRequest",
    "GenerateResult",
    "PauseMode",
    "SGLangEngine",
    "SGLangEngineConfig",
    "SamplingParams",
    "expand_version_spans",
]
