"""Multi-turn tool use through the real entry point (`yaml_configs/tiny-tools-cpu.yaml`).

Contracts checked, on real torchrun, megatron-core, gloo, SGLang and tool worker processes:
- every sample is a trajectory (a plug-in environment here, `tests/e2e/slow_tools.py`: its
  first step takes 0.3 s and answers with a tool message): the engine's tokens trained, the
  environment's masked (`multiturn/masked_token_frac` strictly between 0 and 1), two turns each;
- asynchronous, one step ahead with in-flight updates: every trained token is within the bound
  (`policy_lag/max` <= 1) and no step loses trajectories (every step trains
  `num_prompts x n` of them), updates landing while trajectories wait for their environment.
"""

import importlib.util
import json

import pytest

from tests.harness.recipes import REPO, launch_command, launch_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]


def test_tool_use_trajectories_train_async_within_the_bound(task, tmp_path):
    import subprocess

    from megatron_async_rl.tasks.calculator import sum_rows, write_rows

    data = write_rows(tmp_path / "calc.jsonl", sum_rows(64, seed=0))
    run_dir = tmp_path / "run"
    sets = (
        f"model.hf_path={task.model}", f"data.path={data}", "trainer.num_steps=3",
        "rollout.num_prompts_per_step=4", "algorithm.num_samples_per_prompt=4",
        "rollout.max_new_tokens=24", "environment.max_total_tokens=80",
        "environment.name=tests.e2e.slow_tools:SlowEcho", "environment.tools=[]",
        "scheduler.generate_ahead_steps=1", "scheduler.weight_update_mode=in_flight",
        "observability.dump_rollouts_every=1", "megatron.micro_batch_size=16",
        "trainer.micro_batch_size=16",
    )  # fmt: skip
    proc = subprocess.run(
        launch_command(REPO / "yaml_configs" / "tiny-tools-cpu.yaml", run_dir, *sets),
        env=launch_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["multiturn/trajectories"] == 16, row  # none lost
        assert 0 < row["multiturn/masked_token_frac"] < 1
        assert row["policy_lag/max"] <= 1
        assert row["multiturn/turns_mean"] == 2
    assert any(row["policy_lag/mixed_samples"] > 0 for row in rows)  # spanning two versions
    dumped = [json.loads(line) for line in
              (run_dir / "rollouts" / "step_00000001.jsonl").read_text().splitlines()]  # fmt: skip
    assert len(dumped) == 16
    for row in dumped:  # the conversation, as the model and the environment wrote it
        by = [turn["by"] for turn in row["conversation"]]
        assert by == ["model", "environment", "model"], row
        assert "<|tool|>42<eos>" in row["conversation"][1]["text"]
        assert row["turns"] == 2 and row["env_reward"] == pytest.approx(0.3)
