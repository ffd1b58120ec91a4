"""Multi-turn rollouts on an engine: many trajectories, turn by turn, token-in/token-out.

Owned here: `generate_trajectories(engine, tokenizer, make_env, samples, prompt_ids,
sampling, limits)`. Every trajectory gets its own environment (`make_env()`) and runs on
its own: each of its turns goes to the engine (continuing from its own token ids,
`rollout/turns.py`) as soon as its environment answered the last one, so the engine batches
whatever turns are in flight while other trajectories wait for their tools (tool latency
overlaps generation; a step is bounded by `step_timeout_s`); the environment's messages are
appended as template tokens, masked out of the loss. A trajectory ends when its
environment says done, at `max_turns`, when its `max_total_tokens` (everything after the
prompt) are spent or an observation would not fit in them (it is not appended: a tool that
answers with a megabyte cannot blow up the training batch), or when its environment fails
(reward 0, counted). The weight version of
every model token is the engine's, so a trajectory that spans a weight update carries both.

A turn the engine returns cut short (an abort: a restart, an in-place pause) is continued
from its partial output, whose tokens keep their versions; when `should_stop()` says the stage
itself was cut (a checkpoint save), `Cut` is raised instead and the step's trajectories are
generated again on resume. Called by `rollout.agentic` (the generate stage's multi-turn path).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from megatron_async_rl.engines.protocol import (
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    version_number,
)
from megatron_async_rl.rollout.environment import (
    Episode,
    EpisodeSample,
    StepResult,
    call_bounded,
    fail_episode,
    record_step,
)
from megatron_async_rl.rollout.turns import Trajectory, close_turn_ids, observation_ids

FINISHED = ("stop", "length")
MAX_CONTINUATIONS = 3
"""Times a turn cut short by the engine is continued before its trajectory fails."""


class Cut(Exception):
    """The generate stage was cut (a save): the trajectories in progress are dropped."""


@dataclass(frozen=True)
class MultiTurnLimits:
    max_turns: int = 4
    max_total_tokens: int = 1024
    """Tokens after the prompt, model and environment tokens together."""
    step_timeout_s: float = 30.0
    max_context_tokens: int | None = None
    """The engine's context length (a turn's input plus its new tokens): a turn never asks for
    more; None: no limit."""
    max_input_tokens: int | None = None
    """SGLang refuses an input of this many tokens or more (its context length less a
    margin): a trajectory whose next input reaches it ends (`budget`); None: no limit."""
    keep_special_tokens: bool = False
    """Decode the model's turns with their special tokens (a tool-call format whose markers
    are special tokens: `tool_calls.decodes_special_tokens`); the end-of-sequence token that
    ends a turn is dropped (`decode_turn`)."""


def generate_trajectories(engine, tokenizer: Any, make_env: Callable[[], Any],
                          samples: list[EpisodeSample], prompt_ids: list[list[int]],
                          sampling: SamplingParams | list[SamplingParams],
                          limits: MultiTurnLimits, rid_prefix: str = "mt",
                          should_stop: Callable[[], bool] | None = None,
                          on_env_span: Callable[[float, float], None] | None = None,
                          ) -> tuple[list, list, Counter]:  # fmt: skip
    """The `Trajectory`s and `Episode`s of `samples`, in order, and counts (`turns`,
    `env_errors`, `env_timeouts`, `budget`, `malformed_calls`, `continued`, `env_s`).
    `sampling`: one for all, or one per sample (its seed then advances by one per turn).
    `on_env_span(start, end)` (wall-clock seconds) gets each turn's environment steps."""
    per_sample = sampling if isinstance(sampling, list) else [sampling] * len(samples)
    return asyncio.run(_run(engine, tokenizer, make_env, samples, prompt_ids, per_sample,
                            limits, rid_prefix, should_stop or (lambda: False),
                            on_env_span))  # fmt: skip


async def _run(engine, tokenizer, make_env, samples, prompt_ids, sampling, limits, rid_prefix,
               should_stop, on_env_span=None):  # fmt: skip
    counts: Counter[str] = Counter()
    trajectories = [Trajectory(list(ids)) for ids in prompt_ids]
    episodes = [Episode() for _ in samples]
    spans: dict[int, list[float]] = {}  # turn -> [first environment start, last end]
    loop = asyncio.get_running_loop()
    # One thread per trajectory for its engine calls: the engine batches whatever is in flight
    with concurrent.futures.ThreadPoolExecutor(max(1, len(samples)), "turn") as threads:

        async def generate(request: GenerateRequest) -> GenerateResult:
            result, continued = await loop.run_in_executor(
                threads, _whole_turn, engine, request, should_stop)
            counts["continued"] += continued
            return result

        async def one(index: int) -> None:
            await _trajectory(index, samples[index], make_env(), trajectories[index],
                              episodes[index], sampling[index], generate, tokenizer, limits,
                              rid_prefix, counts, spans)  # fmt: skip

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(samples))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    if on_env_span is not None:
        for turn in sorted(spans):
            on_env_span(*spans[turn])
    return trajectories, episodes, counts


async def _trajectory(index, sample, env, trajectory, episode, own, generate, tokenizer, limits,
                      rid_prefix, counts, spans) -> None:  # fmt: skip
    """One trajectory, turn after turn, on its own: its next turn goes to the engine as soon as
    its environment answered, whatever the other trajectories are doing (tool latency overlaps
    their generation)."""
    outcome = await _guarded(env.reset, sample, limits)
    if isinstance(outcome, BaseException):
        fail_episode(episode, outcome)
        _count_failure(episode, counts)
        return
    episode.observations.append(outcome)
    for turn in range(limits.max_turns):
        left, length = limits.max_total_tokens - len(trajectory.ids), len(trajectory.context())
        if limits.max_context_tokens is not None:
            left = min(left, limits.max_context_tokens - length)
        if limits.max_input_tokens is not None and length >= limits.max_input_tokens:
            left = 0
        if left < 1:
            episode.finish_reason = "budget"
            counts["budget"] += 1
            return
        budget = replace(own, max_new_tokens=min(own.max_new_tokens, left),
                         seed=None if own.seed is None else own.seed + turn)  # fmt: skip
        result = await generate(GenerateRequest(trajectory.context(), budget,
                                                f"{rid_prefix}-{index}-t{turn}"))  # fmt: skip
        trajectory.add_model(list(result.output_ids), list(result.output_logprobs),
                             [version_number(v) for v in result.token_versions])  # fmt: skip
        action = decode_turn(tokenizer, list(result.output_ids), limits.keep_special_tokens)
        episode.actions.append(action)
        counts["turns"] += 1
        started, wall = time.perf_counter(), time.time()
        outcome = await _guarded(env.step, action, limits)
        counts["env_s"] += time.perf_counter() - started
        span = spans.setdefault(turn, [wall, wall])
        span[0], span[1] = min(span[0], wall), max(span[1], time.time())
        if isinstance(outcome, StepResult):
            counts["malformed_calls"] += int(outcome.info.get("malformed_calls", 0))
        if not record_step(episode, outcome):
            if episode.error:
                _count_failure(episode, counts)
            return
        messages = _as_messages(outcome.observation)
        env_ids = close_turn_ids(tokenizer, trajectory.ids)
        if messages:
            calls = (getattr(outcome, "info", None) or {}).get("tool_calls")
            env_ids += observation_ids(tokenizer, messages, calls)
        room = limits.max_total_tokens - len(trajectory.ids)
        if limits.max_context_tokens is not None:
            room = min(room, limits.max_context_tokens - len(trajectory.context()))
        if len(env_ids) > room:  # it would outgrow the budget (and the trainer's memory)
            episode.finish_reason = "budget"
            counts["budget"] += 1
            counts["observation_too_long"] += 1
            return
        trajectory.add_environment(env_ids)
    episode.finish_reason = "max_turns"


def _whole_turn(engine, request: GenerateRequest, should_stop) -> tuple[GenerateResult, int]:
    """(`request`'s result, times it was continued): a result cut short is continued from its
    partial output (`engines.recovery.prefixes`: its tokens kept, with their versions) up to
    `MAX_CONTINUATIONS` times; `Cut` when the stage was cut."""
    from megatron_async_rl.engines.recovery import prefixes

    (result,) = engine.generate([request])
    for continued in range(MAX_CONTINUATIONS + 1):
        if result.finish_reason in FINISHED:
            return result, continued
        if should_stop():
            raise Cut
        if continued == MAX_CONTINUATIONS:
            break
        (more,) = engine.generate([prefixes.continuation(request, result)])
        result = prefixes.joined(result, more)
    raise RuntimeError(
        f"the engine cut turn {request.rid} short {MAX_CONTINUATIONS + 1} times in a row, and "
        "nothing asked it to; see the engine's log"
    )


def decode_turn(tokenizer, ids: list[int], keep_special_tokens: bool) -> str:
    """A model turn as the environment reads it: without special tokens, or with them but
    without the end-of-sequence (or padding) tokens that close it (a format's own closing
    markers, e.g. gpt-oss's `<|call|>`, stay: its detector reads them)."""
    if not keep_special_tokens:
        return tokenizer.decode(ids, skip_special_tokens=True)
    closing = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    while ids and ids[-1] in closing:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


async def _guarded(fn, arg, limits: MultiTurnLimits):
    try:
        return await call_bounded(fn, arg, limits.step_timeout_s)
    except Exception as err:  # noqa: BLE001 - ends only this trajectory, counted
        return err


def _count_failure(episode: Episode, counts: Counter) -> None:
    counts["env_timeouts" if episode.finish_reason == "env_timeout" else "env_errors"] += 1


def _as_messages(observation) -> list[dict]:
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return list(observation)
