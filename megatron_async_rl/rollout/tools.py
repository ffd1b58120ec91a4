"""Tools a policy may call: declared in the recipe, described to the chat template, run bounded.

Owned here: `load_tools(specs)` (Python callables or `module:function` strings -> `Tool`s, each
with the JSON schema chat templates take, made by `transformers.utils.get_json_schema` from the
signature and the Google-style docstring), and `ToolRunner`, which runs a turn's calls in
worker processes (`processes.worker_pool.WorkerPool`: code a tool runs cannot hang or crash the
rank; a call past `timeout_s` is cut) and turns every outcome into the text of a `tool`
message: the result as JSON (or text; past `max_chars` cut, with a note), or an error the
model can read. Unknown tools, bad arguments, exceptions and timeouts are errors, each counted
by kind (`counts`), as are truncated results.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.plugins import import_named
from megatron_async_rl.processes.worker_pool import CallTimeout, WorkerPool
from megatron_async_rl.rollout.tool_calls import ToolCall


@dataclass(frozen=True)
class Tool:
    name: str
    spec: str
    """`module:function` (what the worker process imports)."""
    schema: dict
    """`{"type": "function", "function": {name, description, parameters}}`."""


def load_tools(specs: list, key: str = "tools") -> dict[str, Tool]:
    """Tools by name from `module:function` strings or module-level functions; a bad spec is
    a ConfigError naming `key[i]`."""
    from transformers.utils import get_json_schema

    tools: dict[str, Tool] = {}
    for index, spec in enumerate(specs):
        where = f"{key}[{index}]"
        fn = _resolve(spec, where)
        name = f"{fn.__module__}:{fn.__qualname__}"
        if "<" in fn.__qualname__ or fn.__module__ == "__main__":
            raise ConfigError(where, spec, "a tool must be a module-level function of an "
                              "importable module (worker processes import it by name)")  # fmt: skip
        try:
            schema = get_json_schema(fn)
        except Exception as err:  # noqa: BLE001 - transformers' own reasons, passed on
            hint = "give it type hints and a docstring with an Args: section"
            raise ConfigError(where, name, f"cannot describe it to the chat template: {err}",
                              hint) from None  # fmt: skip
        tool_name = schema["function"]["name"]
        if tool_name in tools:
            raise ConfigError(where, name, f"a second tool named {tool_name!r}")
        tools[tool_name] = Tool(tool_name, name, schema)
    return tools


def _resolve(spec, where: str) -> Callable:
    if callable(spec) and inspect.isfunction(spec):
        return spec
    from megatron_async_rl.sandbox.tools import BUILTIN

    spec = BUILTIN.get(spec, spec)  # `python`, `bash`: code run in the sandbox
    fn = import_named(spec, where, "module:function or a function")
    if not inspect.isfunction(fn):
        raise ConfigError(where, spec, f"is a {type(fn).__name__}, not a function")
    return fn


def _run_tool(spec: str, arguments: dict):
    module_name, attr = spec.split(":")
    return getattr(importlib.import_module(module_name), attr)(**arguments)


class ToolRunner:
    """`run(calls)` -> one `tool` message text per call, in order, run in `workers`
    processes, each within `timeout_s`."""

    def __init__(self, tools: dict[str, Tool], workers: int = 2, timeout_s: float = 10.0,
                 max_chars: int = 4096, sandbox=None):  # fmt: skip
        """`sandbox`: a `SandboxConfig`, the limits of the built-in `python` and `bash` tools
        in these workers (None: their defaults)."""
        self.tools, self.max_chars = tools, max_chars
        init = None
        if sandbox is not None:
            from megatron_async_rl.sandbox.tools import use_config

            init = functools.partial(use_config, sandbox)
        self.pool = WorkerPool(workers, timeout_s, "tool call", initializer=init)
        self.counts: Counter[str] = Counter()
        """`calls`, `unknown_tool`, `bad_arguments`, `raised`, `timeout`, `truncated`; the
        sandbox's tools' outcomes, `sandbox_<outcome>` (`sandbox.tools.Answer`)."""

    def run(self, calls: list[ToolCall]) -> list[str]:
        out: list[str | None] = [None] * len(calls)
        jobs: list[tuple[int, tuple]] = []
        for index, call in enumerate(calls):
            self.counts["calls"] += 1
            tool = self.tools.get(call.name)
            if tool is None:
                self.counts["unknown_tool"] += 1
                out[index] = (f"error: no tool named {call.name!r}; tools: "
                              f"{', '.join(sorted(self.tools))}")  # fmt: skip
                continue
            problem = _check_arguments(tool, call.arguments)
            if problem:
                self.counts["bad_arguments"] += 1
                out[index] = f"error: {call.name}: {problem}"
                continue
            jobs.append((index, (tool.spec, call.arguments)))
        results = self.pool.run_many(_run_tool, [args for _, args in jobs])
        for (index, _), result in zip(jobs, results, strict=True):
            if isinstance(result, CallTimeout):
                self.counts["timeout"] += 1
                out[index] = f"error: {calls[index].name} did not answer within " \
                             f"{self.pool.call_timeout_s:g} s"  # fmt: skip
            elif isinstance(result, Exception):
                self.counts["raised"] += 1
                out[index] = f"error: {calls[index].name} raised {type(result).__name__}: {result}"
            else:
                outcome = getattr(result, "outcome", None)  # the sandbox's tools
                if outcome is not None:
                    self.counts[f"sandbox_{outcome}"] += 1
                out[index] = self._bounded(result if isinstance(result, str)
                                           else json.dumps(result))  # fmt: skip
        return [text or "" for text in out]

    def _bounded(self, text: str) -> str:
        """A result past `max_chars` is cut there, with a note the model reads (counted)."""
        if len(text) <= self.max_chars:
            return text
        self.counts["truncated"] += 1
        return f"{text[: self.max_chars]}... [truncated: {len(text)} characters in all]"

    def close(self) -> None:
        self.pool.close()


def _check_arguments(tool: Tool, arguments: dict) -> str | None:
    params = tool.schema["function"].get("parameters", {})
    known = set(params.get("properties", {}))
    missing = [p for p in params.get("required", []) if p not in arguments]
    unknown = [a for a in arguments if a not in known]
    if missing:
        return f"missing argument(s) {', '.join(missing)}"
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)}; it takes {', '.join(sorted(known))}"
    return None
