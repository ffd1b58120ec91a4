"""PPO with a critic through the real entry point (`yaml_configs/tiny-ppo-cpu.yaml`).

Contracts checked (2 RL steps, the first a critic warm-up step):
- at `generate_ahead_steps: 0` the asynchronous loop reproduces the synchronous loop exactly
  with a critic: every metric but timings is identical at every step (rewards, GAE's
  advantages and returns, the critic's value loss, gradient norm and explained variance, the
  actor's loss);
- the warm-up trains the critic alone (no actor optimizer step at step 0, one at step 1) and
  the critic's optimizer steps every step;
- its checkpoint holds the critic's model and optimizer next to the actor's.
Nothing is faked: real torchrun, megatron-core, gloo and SGLang on CPU.
"""

import importlib.util
import json
import subprocess

import pytest

from tests.e2e.recipe_runs import REPO, launch_command, launch_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]
RECIPE = REPO / "yaml_configs" / "tiny-ppo-cpu.yaml"
SETS = ("trainer.num_steps=2", "critic.warmup_steps=1", "rollout.num_prompts_per_step=8",
        "scheduler.generate_ahead_steps=0",
        "reward.name=tests.e2e.test_ppo_job:odd_first_character")  # fmt: skip
VOLATILE = ("timing/", "throughput/", "scheduler/", "utilization/", "weight_sync/GB_per_s",
            "weight_sync/stall_s", "checkpoint/")  # fmt: skip


def odd_first_character(response_text: str, answer: str, metadata: dict) -> float:
    """A reward the untrained test model earns about half the time, so returns vary."""
    return float(bool(response_text) and ord(response_text[0]) % 2 == 1)


def _run(task, run_dir, port, *sets) -> list[dict]:
    sets = (f"model.hf_path={task.model}", f"data.path={task.data}", *SETS, *sets)
    proc = subprocess.run(launch_command(RECIPE, run_dir, *sets), env=launch_env(port),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_ppo_async_at_zero_steps_ahead_is_the_synchronous_loop(task, tmp_path):
    sync = _run(task, tmp_path / "sync", 29694)
    async_ = _run(task, tmp_path / "async", 29695, "scheduler.loop=async")
    assert len(sync) == len(async_) == 2
    for a, b in zip(sync, async_, strict=True):
        assert _stable(a) == _stable(b)
    assert "actor/optimizer_steps" not in sync[0] and sync[1]["actor/optimizer_steps"] == 1.0
    for row in sync:
        assert row["critic/optimizer_steps"] == 1.0
        assert row["critic/value_loss"] > 0 and row["critic/grad_norm"] > 0
        assert 0 < row["reward/mean"] < 1 and "critic/explained_var" in row
    saved = sorted((tmp_path / "sync" / "checkpoints").glob("step_*"))
    assert saved and (saved[-1] / "critic").is_dir() and (saved[-1] / "megatron").is_dir()
