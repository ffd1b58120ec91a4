"""Contract of `tasks/warm_start.py`: a short supervised run that saves a loadable HF model.

- The command line (the real entry point, in a subprocess: transformers must not share a
  process with `megatron_async_rl.compat`) writes an HF directory that `AutoModelForCausalLM`
  and `AutoTokenizer` load, plus `warm_start_metrics.json` with greedy and temperature-1.0
  accuracy and format rate.
- The metrics mean what they say: after plain SFT (`mode="correct"`) on a 16-problem task the
  model answers nearly every prompt right in the format, while with `random_answers` it keeps
  the format but not the answers (accuracy far below SFT's).
- Same seed, same weights (byte-identical safetensors).
Model: the tiny llama from `models/tiny.py` (hidden 64, 2 layers), made in `tmp_path`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_async_rl.models.tiny import write_tiny_model
from megatron_async_rl.tasks.arithmetic import write_arithmetic_dataset

REPO_ROOT = Path(__file__).resolve().parents[2]
METRIC_KEYS = {
    f"warm_start/{mode}/{name}"
    for mode in ("greedy", "sample")
    for name in ("accuracy", "format_rate")
}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    model = write_tiny_model(root / "tiny-llama", "llama", seed=0)
    data = write_arithmetic_dataset(root / "train.jsonl", 200, seed=0, max_operand=3)
    return root, model, data


def test_command_line_writes_a_loadable_model(task):
    root, model, data = task
    out = root / "cli-out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_async_rl.tasks.warm_start", "--model", str(model),
         "--data", str(data), "--out", str(out), "--steps", "5", "--seed", "0"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((out / "warm_start_metrics.json").read_text())
    assert METRIC_KEYS <= set(metrics)
    assert all(0.0 <= metrics[key] <= 1.0 for key in METRIC_KEYS)
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.config.hidden_size == 64 and tokenizer.decode(tokenizer.encode("3+5=")) == "3+5="
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        "PreTrainedTokenizerFast"
    )


def test_metrics_separate_sft_from_format_only_training(task):
    from megatron_async_rl.tasks.warm_start import warm_start

    root, model, data = task
    sft = warm_start(model, data, root / "sft", steps=120, lr=3e-3, batch_size=32, seed=0,
                     mode="correct", num_samples=4)  # fmt: skip
    assert sft["warm_start/greedy/accuracy"] >= 0.9
    assert sft["warm_start/greedy/format_rate"] >= 0.9
    fmt = warm_start(model, data, root / "fmt", steps=120, lr=3e-3, batch_size=32, seed=0,
                     mode="random_answers", num_samples=4)  # fmt: skip
    assert fmt["warm_start/greedy/format_rate"] >= 0.9
    assert fmt["warm_start/sample/format_rate"] >= 0.9
    assert fmt["warm_start/sample/accuracy"] <= 0.5 * sft["warm_start/sample/accuracy"]


def test_greedy_generation_matches_transformers_generate(task):
    import torch
    import transformers

    from megatron_async_rl.tasks.warm_start import generate, warm_start

    root, model, data = task
    warm_start(model, data, root / "gen", steps=30, lr=3e-3, batch_size=16, seed=1)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "gen").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "gen")
    prompts = [tokenizer.encode(p) for p in ("0+0=", "3+3=", "1+2=", "12+3=")]
    ours = generate(loaded, prompts, 4, tokenizer.eos_token_id, 0.0, torch.Generator())
    for ids, got in zip(prompts, ours):
        reference = loaded.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=4, pad_token_id=0,
            eos_token_id=tokenizer.eos_token_id,
        )[0, len(ids) :].tolist()  # fmt: skip
        assert got == reference


def test_same_seed_same_weights(task):
    from megatron_async_rl.tasks.warm_start import warm_start

    root, model, data = task
    runs = [
        warm_start(
            model, data, root / f"det{i}", steps=4, lr=1e-3, batch_size=8, seed=3, num_samples=2
        )  # fmt: skip
        for i in range(2)
    ]
    first, second = ((root / f"det{i}" / "model.safetensors").read_bytes() for i in range(2))
    assert first == second
    assert {k: v for k, v in runs[0].items() if k != "warm_start/time_s"} == {
        k: v for k, v in runs[1].items() if k != "warm_start/time_s"
    }


def test_bad_arguments(task):
    from megatron_async_rl.tasks.warm_start import warm_start

    root, model, data = task
    with pytest.raises(ValueError, match="mode = 'sft': must be one of"):
        warm_start(model, data, root / "x", mode="sft")
    with pytest.raises(ValueError, match="batch_size = 0"):
        warm_start(model, data, root / "x", batch_size=0)
