"""Environments for multi-turn rollouts: the interface, the registry, and one episode's driver.

Owned here:
- the interface an environment implements, sync or `async def` alike (one instance per
  trajectory, so its state is the trajectory's):

      reset(sample: EpisodeSample) -> observation          # text, messages, or None
      step(action: str) -> StepResult(observation, reward, done, info)

- `load_environment(spec, key)`: `tools` (the built-in `ToolEnvironment`) or `module:Class`
  (a plug-in, like the rewards'); its keyword arguments come from the recipe.
- `run_episode(env, policy, sample, limits)`: the turn loop. `policy(observation)` is the
  model's next action (the rollout side supplies it; it keeps the conversation's token ids so
  the tokens trained are the tokens sampled). The loop ends on `done`, at `max_turns`, or
  when `policy` says the token budget is spent. An environment that raises, or whose step
  does not answer within `step_timeout_s`, ends its trajectory with reward 0 and a counted
  error (`finish_reason` says which); the run goes on. A sync step runs on a helper thread so
  that it can be timed out (a hung one is abandoned there; an async one is cancelled).
- `ToolEnvironment`: the model calls tools (`rollout/tools.py`, `rollout/tool_calls.py`);
  results and errors go back as `tool` messages; a turn without a call is the final answer,
  scored by the run's reward function.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.plugins import import_named
from megatron_async_rl.rollout.tool_calls import parse_tool_calls
from megatron_async_rl.rollout.turns import openai_calls


@dataclass(frozen=True)
class EpisodeSample:
    """What `reset` gets: the row's prompt (text or messages), answer and metadata."""

    prompt: Any
    answer: str = ""
    metadata: dict = field(default_factory=dict)


@dataclass
class StepResult:
    observation: Any = None
    """Text, messages (`[{role, content}]`) or None: what the policy sees next."""
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    step_timeout_s: float = 30.0


@dataclass
class Episode:
    actions: list[str] = field(default_factory=list)
    observations: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    """Per turn; the trajectory's reward is their sum (`reward`)."""
    finish_reason: str = ""
    """`done`, `max_turns`, `budget`, `env_error` or `env_timeout`."""
    error: str | None = None

    @property
    def reward(self) -> float:
        return 0.0 if self.error else float(sum(self.rewards))


class BudgetSpent(Exception):
    """Raised by a policy whose trajectory has no tokens left (`max_total_tokens`)."""


async def call_bounded(fn: Callable, arg, timeout_s: float):
    """`fn(arg)`, sync or async, within `timeout_s` (TimeoutError past it)."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(fn(arg), timeout_s)
    return await asyncio.wait_for(_on_daemon_thread(fn, arg), timeout_s)


def _on_daemon_thread(fn: Callable, arg) -> asyncio.Future:
    """`fn(arg)` on a thread of its own, daemon, so that a step that hangs past its timeout
    is abandoned there (a thread cannot be killed) without holding up the loop's shutdown."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def work() -> None:
        try:
            outcome = (True, fn(arg))
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting episode
            outcome = (False, err)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is gone: the episode ended on its timeout long ago
            pass

    threading.Thread(target=work, name="env-step", daemon=True).start()
    return future


async def run_episode(env, policy: Callable[[Any], Awaitable[str] | str], sample: EpisodeSample,
                      limits: EpisodeLimits) -> Episode:  # fmt: skip
    """One trajectory (see the module docstring). `policy` may be sync or `async def`."""
    episode = Episode()
    try:
        observation = await call_bounded(env.reset, sample, limits.step_timeout_s)
    except Exception as err:  # noqa: BLE001 - the environment's failure ends this trajectory
        return fail_episode(episode, err)
    episode.observations.append(observation)
    for _ in range(limits.max_turns):
        try:
            action = policy(observation)
            if inspect.isawaitable(action):
                action = await action
        except BudgetSpent:
            episode.finish_reason = "budget"
            return episode
        episode.actions.append(action)
        try:
            result = await call_bounded(env.step, action, limits.step_timeout_s)
        except Exception as err:  # noqa: BLE001 - as above
            result = err
        if not record_step(episode, result):
            return episode
        observation = result.observation
    episode.finish_reason = "max_turns"
    return episode


def record_step(episode: Episode, outcome) -> bool:
    """Add a step's outcome (a StepResult, or the exception the step raised) to `episode`;
    whether the trajectory goes on. A failure or a wrong type ends it (`fail_episode`), as does
    `done`."""
    if not isinstance(outcome, StepResult):
        if not isinstance(outcome, BaseException):
            outcome = TypeError(f"step returned {type(outcome).__name__}, expected StepResult")
        fail_episode(episode, outcome)
        return False
    episode.rewards.append(float(outcome.reward))
    episode.observations.append(outcome.observation)
    if outcome.done:
        episode.finish_reason = "done"
        return False
    return True


def fail_episode(episode: Episode, err: BaseException) -> Episode:
    """End `episode` on its environment's failure: reward 0, `finish_reason` env_timeout or
    env_error."""
    timeout = isinstance(err, (TimeoutError, asyncio.TimeoutError))
    episode.finish_reason = "env_timeout" if timeout else "env_error"
    episode.error = f"{type(err).__name__}: {err}" if not timeout else "a step timed out"
    return episode


class ToolEnvironment:
    """The built-in `tools` environment (module docstring). `reward_fn`: the run's reward,
    `fn(response_text, answer, metadata)`, applied to the final answer (None: reward 0)."""

    def __init__(self, runner, reward_fn: Callable | None = None, fmt: str = "hermes"):
        self.runner, self.reward_fn, self.fmt = runner, reward_fn, fmt
        self.schemas = [tool.schema for tool in getattr(runner, "tools", {}).values()]
        self.sample: EpisodeSample | None = None
        self.malformed = 0

    def reset(self, sample: EpisodeSample):
        self.sample = sample
        return None  # the prompt is the first observation

    def step(self, action: str) -> StepResult:
        turn = parse_tool_calls(action, self.fmt, self.schemas)
        if not turn.calls and not turn.errors:
            sample = self.sample or EpisodeSample(prompt=None)
            reward = (self.reward_fn(action, sample.answer, sample.metadata)
                      if self.reward_fn is not None else 0.0)  # fmt: skip
            return StepResult(None, float(reward), True)
        self.malformed += len(turn.errors)
        messages = [{"role": "tool", "content": f"error: {e}"} for e in turn.errors]
        calls = openai_calls(turn.calls)  # the chat template renders each answer from its call
        for call, text in zip(calls, self.runner.run(turn.calls), strict=True):
            messages.append({"role": "tool", "content": text, "tool_call_id": call["id"],
                             "name": call["function"]["name"]})  # fmt: skip
        return StepResult(messages, 0.0, False, {"malformed_calls": len(turn.errors),
                                                 "tool_calls": calls})  # fmt: skip


def load_environment(spec: str, key: str = "environment.name", **kwargs) -> Callable[[], Any]:
    """A factory of fresh environments (one per trajectory) for `module:Class`; the built-in
    `tools` is made by the rollout side, which owns the tool runner and the reward."""
    cls = import_named(spec, key, "module:Class (or the built-in 'tools')")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(key, spec, f"lacks {' and '.join(missing)}: an environment has "
                          "reset(sample) and step(action)")  # fmt: skip
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{key.rpartition('.')[0] or key}.kwargs", kwargs,
                          f"{spec} does not take them: {err}") from None  # fmt: skip
    except ValueError:  # no signature to read (a builtin): its constructor will say
        pass
    return lambda: cls(**kwargs)
