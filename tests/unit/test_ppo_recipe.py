"""The 32-GPU PPO recipe with critic and reward-model windows (yaml_configs/ppo-rm-32gpu.yaml).

Contract: `--dry-run --world-size 32 --ranks-per-node 8` exits 0 without the checkpoints (the
architecture is in the recipe) and prints each window: train 0-7, logp and ref 8-11, critic
12-15 (with grads and optimizer state: it trains), reward_model 16-19 (weights only: frozen),
six engines on 20-31.
"""

import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "yaml_configs" / "ppo-rm-32gpu.yaml"


def test_dry_run_places_critic_and_reward_model_windows():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_async_rl.train", "--config", str(RECIPE), "--dry-run",
         "--world-size", "32", "--ranks-per-node", "8"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "critic    ranks 12-15: device" in out and "optimizer" in out.split("critic ")[1]
    rm_line = next(line for line in out.splitlines() if "reward_model ranks 16-19" in line)
    assert "grads" not in rm_line and "optimizer" not in rm_line
    assert "engine 5: ranks 30-31" in out
