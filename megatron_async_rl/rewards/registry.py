"""Reward lookup: names, `module:function` plug-ins, the remote reward, and error isolation.

Owned here: the registry (`register`, `get_reward`, configured by the recipe's `reward:`
section, `rewards.config.RewardConfig`) and `SafeReward`, the wrapper the reward stage calls on
every generated sample. The built-in rewards live one per file: `math_answer.py` next to this
one registers `math`, the demo task's `tasks/arithmetic_reward.py` registers `arithmetic` (both
imported by name on first lookup); `remote.py` is built from a `RewardConfig` with a URL.

A reward function has the signature

    fn(response_text: str, answer: str, metadata: dict) -> float

and is pure: it sees the decoded response (special tokens removed or not, it must cope), the
row's ground truth ("" for a row without one, with `data.answer_required: false`) and the
row's `metadata` object plus `prompt` (the prompt text or messages) and `row` (all the row's
fields). It may be `async def` (a step's samples are then awaited concurrently), or an object
whose `score_batch(items)` takes a step's (response_text, answer, metadata) at once and
returns one value (or exception) per item. `SafeReward` turns an exception, or a value that is not
a finite number, into reward 0.0, counts it (`reward/errors`) and logs the first few with the
sample's uid, so one bad sample never stops a run and never passes unnoticed.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from megatron_async_rl.config.errors import ConfigError, suggest
from megatron_async_rl.processes.isolated import FAULT_KEY, IsolatedReward
from megatron_async_rl.rewards.config import REMOTE, RewardConfig

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str, dict], float]

_REGISTRY: dict[str, RewardFn] = {}
# Modules whose import registers the built-in names; imported on first lookup so that importing
# the registry alone stays cheap and free of cycles.
_BUILTIN_MODULES = (
    "megatron_async_rl.rewards.math_answer",
    "megatron_async_rl.tasks.arithmetic_reward",
)


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` available to `get_reward(name)`."""
    if not name or ":" in name or name == REMOTE:
        raise ValueError(f"reward name {name!r}: must be non-empty, without ':', not {REMOTE!r}")

    def decorate(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        # Re-registering the same function (a module imported twice) is harmless.
        if existing is not None and existing.__qualname__ != fn.__qualname__:
            raise ValueError(f"reward {name!r} is already registered to {existing.__qualname__}")
        _REGISTRY[name] = fn
        return fn

    return decorate


def registered_names() -> list[str]:
    """Every registered reward name (built-ins included), sorted, plus `remote`."""
    _import_builtins()
    return sorted([*_REGISTRY, REMOTE])


def get_reward(spec: str | RewardConfig, key: str = "reward.name") -> RewardFn:
    """The reward function for a name, a `module:function` or a `RewardConfig`.

    `key` is the recipe path the spec came from; every lookup error is a `ConfigError` naming it.
    """
    config = spec if isinstance(spec, RewardConfig) else None
    name = config.name if config is not None else spec
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(key, name, "must be a reward name or module:function")
    if name == REMOTE:
        if config is None:
            raise ConfigError(
                key, name, "the remote reward needs a URL", "pass a RewardConfig with url set"
            )
        from megatron_async_rl.rewards.remote import RemoteReward

        return RemoteReward(config.url, config.timeout_s, config.max_retries, config.backoff_s)
    fn = _load_plugin(name, key) if ":" in name else _lookup(name, key)
    _check_signature(fn, name, key)
    if config is not None and hasattr(fn, "with_config"):  # a built-in with recipe knobs
        fn = fn.with_config(config)
    return fn


def _import_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def _lookup(name: str, key: str) -> RewardFn:
    _import_builtins()
    if name not in _REGISTRY:
        hint = suggest(name, registered_names())
        plugin = "or give module:function for your own reward"
        raise ConfigError(key, name, "unknown reward name", f"{hint}; {plugin}" if hint else plugin)
    return _REGISTRY[name]


def _load_plugin(spec: str, key: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigError(key, spec, "expected module:function, e.g. my_pkg.rewards:score")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a plug-in may fail to import in any way; report which and why
        raise ConfigError(
            key,
            spec,
            f"cannot import module {module_name!r}: {type(err).__name__}: {err}",
            "check that it is on PYTHONPATH and imports cleanly",
        ) from err
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(key, spec, f"module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(key, spec, f"{attr!r} is a {type(fn).__name__}, not a function")
    return fn


CONTRACT = ("response_text", "answer", "metadata")
"""The reward's parameters, in order: the decoded response, the row's answer, the row's
`metadata` object ({} when the row has none). Checked by name and kind, not only by count."""


def _check_signature(fn: RewardFn, name: str, key: str) -> None:
    """Strict: the first three parameters are `response_text, answer, metadata`, positional
    (a function named otherwise, e.g. `(prompt, response, answer=None, **kw)`, would score the
    wrong thing); any further ones have defaults."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust them
    params = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params[:3]]
    required_rest = [
        p.name for p in params[3:]
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]  # fmt: skip
    if (
        names != list(CONTRACT)
        or any(p.kind not in positional for p in params[:3])
        or required_rest
    ):
        raise ConfigError(
            key, name,
            f"reward takes {signature}; the contract is fn(response_text, answer, metadata) -> "
            "float, in that order (metadata: the row's metadata object)",
            "rename the parameters; give any further one a default",
        )  # fmt: skip


@dataclass(frozen=True)
class RewardRequest:
    """One sample to score; `SafeReward.score` accepts any object with these attributes."""

    uid: str
    response_text: str
    answer: str
    metadata: dict = field(default_factory=dict)


async def _awaited(awaitable):
    return await awaitable


def _checked(value) -> float:
    """A reward's value as a float; a non-number or a non-finite one raises."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, expected a finite float")
    return float(value)


def safe_reward(config: RewardConfig) -> SafeReward:
    """The recipe's reward, guarded: in a child process with a per-call bound when
    `reward.call_timeout_s` is set (`processes.isolated`), else in this process."""
    fn = get_reward(config)  # in this process too: a bad name fails here, before any child
    if config.call_timeout_s is not None:
        fn = IsolatedReward(config, config.call_timeout_s, get_reward)
    return SafeReward(fn, config.name, stop_on_failure=config.on_failure == "stop",
                      max_error_rate=config.max_error_rate)  # fmt: skip


class SafeReward:
    """Calls a reward function; an exception, a timeout (`processes.isolated`) or a non-finite
    value scores 0.0 and is counted."""

    def __init__(self, fn: RewardFn, name: str = "", max_logged: int = 5,
                 stop_on_failure: bool = False, max_error_rate: float = 1.0):  # fmt: skip
        """`stop_on_failure` (`reward.on_failure: stop`): a failure raises instead.
        `max_error_rate` (`reward.max_error_rate`): `score` stops the run when more than this
        share of its samples failed."""
        self.fn, self.stop_on_failure = fn, stop_on_failure
        self.max_error_rate = max_error_rate
        self.first_error: str | None = None
        self._taken = (0, 0, 0)  # (errors, timeouts, calls) at the last take_metrics
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        self.max_logged = max_logged
        self.errors = 0
        self.timeouts = 0
        self.calls = 0

    def __call__(self, response_text: str, answer: str, metadata: dict, uid: str = "?",
                 fault: str | None = None) -> float:  # fmt: skip
        self.calls += 1
        try:
            if fault == "raise":
                raise RuntimeError("fault injection: the reward raised (faults.reward_raise_steps)")
            if fault == "hang":  # only an isolated reward (reward.call_timeout_s) gets one
                metadata = {**metadata, FAULT_KEY: "hang"}
            value = self.fn(response_text, answer, metadata)
            if inspect.isawaitable(value):  # an `async def` reward, called alone
                value = asyncio.run(_awaited(value))
            return _checked(value)
        except Exception as err:  # any failure of user code scores 0 and is counted, by design
            return self._failed(err, uid)

    def _batch_fn(self):
        """How `score` can take a step's samples at once: the reward's own `score_batch`, or,
        for an `async def` reward, every call awaited concurrently; None: one by one."""
        batch = getattr(self.fn, "score_batch", None)
        if batch is not None:
            return batch
        method = vars(type(self.fn)).get("__call__")  # an object with `async def __call__`
        if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(method):
            return self._gather
        return None

    def _gather(self, items: list[tuple[str, str, dict]]) -> list:
        async def one(response_text, answer, metadata):
            try:
                return await self.fn(response_text, answer, metadata)
            except Exception as err:  # noqa: BLE001 - counted per sample by `score`
                return err

        async def every():
            return await asyncio.gather(*(one(*item) for item in items))

        return asyncio.run(every())

    def _failed(self, err: Exception, uid: str) -> float:
        self.errors += 1
        self.first_error = self.first_error or f"{type(err).__name__}: {err}"
        self.timeouts += isinstance(err, TimeoutError)
        if self.stop_on_failure:
            raise RuntimeError(
                f"reward {self.name} failed on sample {uid} and reward.on_failure is stop: "
                f"{type(err).__name__}: {err}"
            ) from err
        if self.errors <= self.max_logged:
            logger.warning(
                "reward %s failed on sample %s (scored 0.0): %s: %s%s",
                self.name,
                uid,
                type(err).__name__,
                err,
                " (further errors are counted, not logged)"
                if self.errors == self.max_logged
                else "",
            )
        return 0.0

    def score(self, samples: Iterable[Any], fault: str | None = None) -> list[float]:
        """Rewards for samples carrying uid, response_text, answer, metadata (in order).
        `fault` (fault injection, `jobs/faults.py`): 'hang' or 'raise' in the first call.
        A reward with `score_batch` (the `math` reward: its Math-Verify pool grades the
        samples at once) gets them in one call, and an `async def` reward is awaited for all
        of them concurrently; each value or exception is counted as here."""
        samples = list(samples)
        before = self.errors
        batch = self._batch_fn()
        if batch is not None and fault is None and samples:
            self.calls += len(samples)
            try:
                results = batch([(s.response_text, s.answer, s.metadata or {}) for s in samples])
            except Exception as err:  # noqa: BLE001 - the whole batch failed: each sample counts
                results = [err] * len(samples)
            values = []
            for s, result in zip(samples, results, strict=True):
                try:
                    if isinstance(result, Exception):
                        raise result
                    values.append(_checked(result))
                except Exception as err:  # noqa: BLE001 - counted like a single call's
                    values.append(self._failed(err, getattr(s, "uid", "?")))
        else:
            values = [
                self(
                    s.response_text,
                    s.answer,
                    s.metadata or {},
                    uid=getattr(s, "uid", "?"),
                    fault=fault if i == 0 else None,
                )  # fmt: skip
                for i, s in enumerate(samples)
            ]
        failed = self.errors - before
        if values and failed / len(values) > self.max_error_rate:
            raise ConfigError(
                "reward.max_error_rate", self.max_error_rate,
                f"reward {self.name} failed on {failed} of the {len(values)} samples of one "
                f"step (the first failure: {self.first_error})",
                "fix the reward function (its first failures are logged above with their "
                "samples), or raise reward.max_error_rate",
            )  # fmt: skip
        return values

    def take_metrics(self) -> dict[str, float]:
        """The step's `reward/errors`, `reward/timeouts` and `reward/calls` (since the last
        take), and `reward/errors_total` since construction."""
        now = (self.errors, self.timeouts, self.calls)
        step = [a - b for a, b in zip(now, self._taken, strict=True)]
        self._taken = now
        return {
            "reward/errors": float(step[0]), "reward/timeouts": float(step[1]),
            "reward/calls": float(step[2]), "reward/errors_total": float(self.errors),
        }  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """`reward/errors`: failed calls since construction (`reward/timeouts` of them cut by
        `reward.call_timeout_s`); `reward/calls`: all calls."""
        return {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts),
                "reward/calls": float(self.calls)}  # fmt: skip
