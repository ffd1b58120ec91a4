"""Multi-turn environments (`rollout/environment.py`): the interface, plug-ins, one episode.

Contracts:
- `run_episode` drives reset/step (sync or async) until `done`, `max_turns` or the policy's
  `BudgetSpent`; rewards are summed per trajectory;
- an environment that raises, returns something else than a StepResult, or does not answer
  within `step_timeout_s` (sync: abandoned on its thread; async: cancelled) ends only that
  trajectory, with reward 0 and `finish_reason` env_error / env_timeout;
- `load_environment` builds fresh instances of a `module:Class` plug-in with the recipe's
  kwargs and refuses a bad spec naming the key;
- `ToolEnvironment` answers calls with `tool` messages (malformed calls as errors, counted),
  and scores the turn without a call with the run's reward.
The policies here are scripted (what the rollout side will supply with an engine); the tool
runner is real (worker processes).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.rollout.environment import (
    BudgetSpent,
    EpisodeLimits,
    EpisodeSample,
    StepResult,
    ToolEnvironment,
    load_environment,
    run_episode,
)
from megatron_async_rl.rollout.tools import ToolRunner, load_tools
from megatron_async_rl.tasks.arithmetic_reward import arithmetic_reward

SAMPLE = EpisodeSample(prompt="12345+67890=", answer="80235")


def _episode(env, policy, **limits):
    return asyncio.run(run_episode(env, policy, SAMPLE, EpisodeLimits(**limits)))


def test_a_plugin_runs_to_done_and_sums_rewards():
    make = load_environment("tests.unit.tool_fixtures:CountdownEnv", turns=3)
    assert make() is not make()  # one instance per trajectory
    seen = []
    episode = _episode(make(), lambda obs: seen.append(obs) or "go")
    assert episode.finish_reason == "done" and episode.reward == 3.0
    assert seen == ["start 12345+67890=", "left 2", "left 1"]
    assert _episode(make(), lambda obs: "go", max_turns=2).finish_reason == "max_turns"

    def broke(obs):
        raise BudgetSpent

    assert _episode(make(), broke).finish_reason == "budget"


class _Faulty:
    def __init__(self, how):
        self.how = how

    def reset(self, sample):
        return None

    def step(self, action):
        if self.how == "raise":
            raise RuntimeError("env bug")
        if self.how == "hang":
            time.sleep(5)
        return "not a StepResult"


@pytest.mark.parametrize("how, reason", [("raise", "env_error"), ("hang", "env_timeout"),
                                         ("wrong", "env_error")])  # fmt: skip
def test_a_failing_environment_ends_its_trajectory_with_zero(how, reason):
    start = time.monotonic()
    episode = _episode(_Faulty(how), lambda obs: "go", step_timeout_s=0.3)
    assert episode.finish_reason == reason and episode.reward == 0.0 and episode.error
    assert time.monotonic() - start < 3  # a hung step is cut at its timeout


def test_bad_plugins_name_the_key():
    with pytest.raises(ConfigError, match="environment.name = 'nope': must be module:Class"):
        load_environment("nope")
    with pytest.raises(ConfigError, match="lacks step"):
        load_environment("tests.unit.tool_fixtures:NotAnEnv")
    with pytest.raises(ConfigError, match="cannot import it"):
        load_environment("tests.unit.tool_fixtures:Missing")


def test_tool_environment_calculator_episode():
    runner = ToolRunner(load_tools(["tests.unit.tool_fixtures:add"]), workers=1)
    env = ToolEnvironment(runner, reward_fn=arithmetic_reward)
    script = iter([
        '<tool_call>{"name": "add", "arguments": {"a": 12345}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 12345, "b": 67890}}</tool_call>'
        "<tool_call>{oops}</tool_call>",
        "80235",
    ])  # fmt: skip
    seen = []
    try:
        episode = _episode(env, lambda obs: seen.append(obs) or next(script))
    finally:
        runner.close()
    assert episode.finish_reason == "done" and episode.reward == 1.0
    # each answer names its call (id and function), which templates such as gpt-oss's render
    assert seen[1] == [{"role": "tool", "content": "error: add: missing argument(s) b",
                        "tool_call_id": "call00001", "name": "add"}]  # fmt: skip
    assert seen[2][0]["content"].startswith("error: tool call is not JSON")
    assert seen[2][1] == {"role": "tool", "content": "80235", "tool_call_id": "call00001",
                          "name": "add"}  # fmt: skip
    assert env.malformed == 1 and runner.counts["bad_arguments"] == 1
    assert isinstance(StepResult(), StepResult)
