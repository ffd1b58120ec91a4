"""Multi-turn rollouts on an engine: many trajectories, turn by turn, token-in/token-out.

Owned here: `generate_trajectories(engine, tokenizer, make_env, samples, prompt_ids,
sampling, limits)`. Every trajectory gets its own environment (`make_env()`). Turn by turn,
the engine generates for every trajectory still running in one batch, each continuing from
its own token ids (`rollout/turns.py`); then every environment steps at once (tool calls and
environment work of all trajectories overlap; a step is bounded by `step_timeout_s`); their
messages are appended as template tokens, masked out of the loss. A trajectory ends when its
environment says done, at `max_turns`, when its `max_total_tokens` (everything after the
prompt) are spent, or when its environment fails (reward 0, counted). The weight version of
every model token is the engine's, so a trajectory that spans a weight update carries both.

What is not here yet (issue 17): the generate stage does not call this (single-turn only);
the learner does not read a per-token loss mask; GRPO groups of whole trajectories,
continuation across a weight update that arrives during a tool call, and the learning tasks.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams, version_number
from megatron_async_rl.rollout.environment import (
    Episode,
    EpisodeSample,
    call_bounded,
    fail_episode,
    record_step,
)
from megatron_async_rl.rollout.turns import Trajectory, close_turn_ids, observation_ids


@dataclass(frozen=True)
class MultiTurnLimits:
    max_turns: int = 4
    max_total_tokens: int = 1024
    """Tokens after the prompt, model and environment tokens together."""
    step_timeout_s: float = 30.0


def generate_trajectories(engine, tokenizer: Any, make_env: Callable[[], Any],
                          samples: list[EpisodeSample], prompt_ids: list[list[int]],
                          sampling: SamplingParams, limits: MultiTurnLimits,
                          rid_prefix: str = "mt") -> tuple[list, list, Counter]:  # fmt: skip
    """The `Trajectory`s and `Episode`s of `samples`, in order, and counts (`turns`,
    `env_errors`, `env_timeouts`, `budget`)."""
    return asyncio.run(_run(engine, tokenizer, make_env, samples, prompt_ids, sampling,
                            limits, rid_prefix))  # fmt: skip


async def _run(engine, tokenizer, make_env, samples, prompt_ids, sampling, limits, rid_prefix):
    counts: Counter[str] = Counter()
    trajectories = [Trajectory(list(ids)) for ids in prompt_ids]
    episodes = [Episode() for _ in samples]
    envs = [make_env() for _ in samples]
    resets = await asyncio.gather(*(_guarded(env.reset, s, limits) for env, s in
                                    zip(envs, samples, strict=True)))  # fmt: skip
    active = []
    for index, outcome in enumerate(resets):
        if isinstance(outcome, BaseException):
            fail_episode(episodes[index], outcome)
            _count_failure(episodes[index], counts)
        else:
            episodes[index].observations.append(outcome)
            active.append(index)
    for turn in range(limits.max_turns):
        requests, running = [], []
        for index in active:
            left = limits.max_total_tokens - len(trajectories[index].ids)
            if left < 1:
                episodes[index].finish_reason = "budget"
                counts["budget"] += 1
                continue
            budget = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, left))
            requests.append(GenerateRequest(trajectories[index].context(), budget,
                                            f"{rid_prefix}-{index}-t{turn}"))  # fmt: skip
            running.append(index)
        if not running:
            return trajectories, episodes, counts
        results = await asyncio.to_thread(engine.generate, requests)
        actions = []
        for index, result in zip(running, results, strict=True):
            versions = [version_number(v) for v in result.token_versions]
            trajectories[index].add_model(list(result.output_ids),
                                          list(result.output_logprobs), versions)  # fmt: skip
            action = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            episodes[index].actions.append(action)
            actions.append(action)
        counts["turns"] += len(running)
        steps = await asyncio.gather(*(_guarded(envs[i].step, a, limits) for i, a in
                                       zip(running, actions, strict=True)))  # fmt: skip
        active = []
        for index, outcome in zip(running, steps, strict=True):
            episode, trajectory = episodes[index], trajectories[index]
            if not record_step(episode, outcome):
                if episode.error:
                    _count_failure(episode, counts)
                continue
            messages = _as_messages(outcome.observation)
            trajectory.add_environment(close_turn_ids(tokenizer, trajectory.ids))
            if messages:
                trajectory.add_environment(observation_ids(tokenizer, messages))
            active.append(index)
    for index in active:
        episodes[index].finish_reason = "max_turns"
    return trajectories, episodes, counts


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
