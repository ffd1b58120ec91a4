"""The built-in tools `python` and `bash` (`environment.tools: [python, bash]`): the model's code
run in the sandbox, every outcome answered to the model as text and named for the counts.

A Python API for your own environments and tools: `run_code(language, code, config)` returns a
`SandboxResult` (e.g. run a task's tests against a model's patch, score by the exit status).
Limits: the recipe's `environment.sandbox` (set in each tool worker at its start, `use_config`),
else the JSON object in `MEGATRON_ASYNC_RL_SANDBOX` (SandboxConfig's keys), else the defaults.
"""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_async_rl.sandbox.config import SandboxConfig
from megatron_async_rl.sandbox.run import SandboxResult, run_code

ENV_VAR = "MEGATRON_ASYNC_RL_SANDBOX"
BUILTIN = {"python": f"{__name__}:python", "bash": f"{__name__}:bash"}
"""Names usable as they are in `environment.tools`."""


class Answer(str):
    """A tool's answer to the model, with the outcome it is counted under (`tools/sandbox_*`):
    "ok", "exit_nonzero", "wall", "cpu", "output", "unavailable"."""

    outcome: str = "ok"

    def __new__(cls, text: str, outcome: str) -> Answer:
        answer = super().__new__(cls, text)
        answer.outcome = outcome
        return answer

    def __reduce__(self):  # across the tool workers' pipes, with its outcome
        return (Answer, (str(self), self.outcome))


def python(code: str) -> str:
    """Run a Python program in a sandbox (no network, no files but its own temporary directory)
    and return its exit status, standard output and standard error.

    Args:
        code: The Python program; print what you want to see.
    """
    return answer(run_code("python", code, config()))


def bash(script: str) -> str:
    """Run a bash script in a sandbox (no network, no files but its own temporary directory)
    and return its exit status, standard output and standard error.

    Args:
        script: The bash script.
    """
    return answer(run_code("bash", script, config()))


def config() -> SandboxConfig:
    return SandboxConfig(**json.loads(os.environ.get(ENV_VAR) or "{}"))


def use_config(limits: SandboxConfig) -> None:
    """In a tool worker, at its start (`ToolRunner`, from `environment.sandbox`): the limits
    the built-in tools run under in this process."""
    os.environ[ENV_VAR] = json.dumps(dataclasses.asdict(limits))


_LIMITS = {
    "wall": "ran past its wall-time limit ({wall_s:g} s) and was stopped",
    "cpu": "used its CPU-time limit ({cpu_s:g} s) and was stopped",
    "output": "wrote more than {max_output_bytes} bytes of output and was stopped",
}


def answer(result: SandboxResult, limits: SandboxConfig | None = None) -> Answer:
    """What the model reads back: the exit status, stdout and stderr (empty ones left out), or
    the limit that stopped the program, with what it wrote before."""
    limits = limits or config()
    if result.error is not None:
        return Answer(f"error: the sandbox could not run the program: {result.error}",
                      "unavailable")  # fmt: skip
    parts = []
    if result.limit is not None:
        parts.append("error: the program " + _LIMITS[result.limit].format(**vars(limits)))
        outcome = result.limit
    else:
        parts.append(f"exit status {result.exit_code}")
        outcome = "ok" if result.exit_code == 0 else "exit_nonzero"
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            parts.append(f"{name}:\n{text.rstrip()}")
    return Answer("\n".join(parts), outcome)
