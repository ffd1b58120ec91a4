"""`roles.generate.EngineHeadStart`: an engine host's first engine is launched before the rank
builds its world and roles, and adopted once by `build_engine`'s first start when its config is
still the engine's; a launch with another config, or one nobody adopts, is killed. The launch
here is a fake (no process); the real launch is adopted in every run of the entry point
(`tests/e2e/test_grpo_job.py` reads the engine host's log line)."""

from __future__ import annotations

import dataclasses

from megatron_async_rl.engines.config import SGLangEngineConfig
from megatron_async_rl.roles.generate import EngineHeadStart


@dataclasses.dataclass
class FakeLaunch:
    config: SGLangEngineConfig
    killed: int = 0

    def kill(self) -> None:
        self.killed += 1


def _config(model: str = "/models/a") -> SGLangEngineConfig:
    return SGLangEngineConfig(model_path=model)


def test_the_launch_is_adopted_once_with_its_config():
    launch = FakeLaunch(_config())
    head = EngineHeadStart(launch)
    assert head.take(_config()) is launch
    assert head.take(_config()) is None  # a restart starts a new engine
    head.close()
    assert launch.killed == 0


def test_a_launch_with_another_config_is_killed_not_adopted():
    launch = FakeLaunch(_config("/models/a"))
    head = EngineHeadStart(launch)
    assert head.take(_config("/run/upcycled")) is None
    assert launch.killed == 1
    head.close()
    assert launch.killed == 1


def test_a_launch_nobody_adopted_is_killed_at_close():
    launch = FakeLaunch(_config())
    head = EngineHeadStart(launch)
    head.close()
    head.close()
    assert launch.killed == 1
    assert head.take(_config()) is None
