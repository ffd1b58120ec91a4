"""MoE routing replay through the real entry point (`yaml_configs/tiny-moe-r3-cpu.yaml`).

A tiny Qwen3-MoE, its engine in bfloat16 and its trainer in float32, under an induced routing
mismatch (`faults.router_noise: 1.0`: the trainer's routers choose their top-k on noisy
scores). One optimizer step per RL step, so the train pass starts from the weights the logp
pass used and, where both route alike, every token's ratio pi / pi_old is exactly 1.

Contracts checked, 2 steps each:
- r3 (asynchronous loop, one step ahead): the real SGLang engine returns each token's experts;
  the logp pass uses them on every token the engine routed (`moe/replay_agreement` 1.0) while
  its routers' own choice disagrees on many (`moe/routing_agreement` < 0.9); the train pass
  replays the same experts (ratio 1 on every token);
- r2 (synchronous): the train pass replays what the logp pass chose (ratio 1 on every token),
  though each pass's own noisy choice differs;
The control, the same noise with replay off, gives ratios away from 1 (`actor/ratio_max` 1.54
over 3 steps in `benchmarks/moe_routing_replay.py`): it is measured there, not here, to keep
the suite's time. Nothing is faked: real torchrun, megatron-core, gloo and SGLang on CPU.
"""

import importlib.util
import json
import subprocess

import pytest

from tests.harness.recipes import REPO, launch_command, launch_env

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]
RECIPE = REPO / "yaml_configs" / "tiny-moe-r3-cpu.yaml"
NOISE = ("faults.allow=true", "faults.router_noise=1.0", "trainer.num_steps=2",
         "rollout.num_prompts_per_step=8", "megatron.global_batch_size=64")  # fmt: skip


def _run(task, model, run_dir, *sets) -> list[dict]:
    sets = (f"model.hf_path={model}", f"data.path={task.data}", *NOISE, *sets)
    proc = subprocess.run(launch_command(RECIPE, run_dir, *sets), env=launch_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def moe_model(tiny_model):
    return tiny_model("qwen3_moe")


def test_r3_replays_the_engines_routing_in_logp_and_train(task, moe_model, tmp_path):
    rows = _run(task, moe_model, tmp_path / "r3", "moe.routing_replay=r3",
                "scheduler.generate_ahead_steps=1")  # fmt: skip
    assert len(rows) == 2
    for row in rows:
        assert row["moe/replay_agreement"] == 1.0, row
        assert row["moe/routing_agreement"] < 0.9, row
        assert row["moe/routing_tokens"] > 0
        assert abs(row["actor/ratio_max"] - 1.0) < 1e-5, row["actor/ratio_max"]


def test_r2_replays_the_logp_pass_routing_in_train(task, moe_model, tmp_path):
    rows = _run(task, moe_model, tmp_path / "r2", "moe.routing_replay=r2",
                "scheduler.generate_ahead_steps=0")  # fmt: skip
    for row in rows:
        assert abs(row["actor/ratio_max"] - 1.0) < 1e-5, row["actor/ratio_max"]
        assert row["moe/routing_agreement"] < 0.9  # the logp pass chose on its own
