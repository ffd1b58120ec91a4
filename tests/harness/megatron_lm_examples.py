"""Megatron-LM's example flag blocks (`tests/data/megatron_lm_examples`) and the recipe a dry
run of one needs; used by `tests/unit/test_megatron_lm_examples.py` and
`test_megatron_lm_examples_by_release.py`.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import yaml

EXAMPLES = Path(__file__).parents[1] / "data" / "megatron_lm_examples"


def example_argv(path: Path) -> list[str]:
    """The flags of one example block, comments and blank lines left out."""
    argv: list[str] = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            argv += shlex.split(line)
    return argv


def _size(argv: list[str], flag: str, default: int = 1) -> int:
    return int(argv[len(argv) - 1 - argv[::-1].index(flag) + 1]) if flag in argv else default


def example_recipe(tmp_path: Path, argv: list[str]) -> tuple[Path, int]:
    """A recipe that places the roles for `argv` (see `test_megatron_lm_examples.py`'s
    docstring), written in `tmp_path`, and the world size it needs."""
    tp, pp = (
        _size(argv, "--tensor-model-parallel-size"),
        _size(argv, "--pipeline-model-parallel-size"),
    )
    cp, ep = _size(argv, "--context-parallel-size"), _size(argv, "--expert-model-parallel-size")
    etp = _size(argv, "--expert-tensor-parallel-size", tp)
    ranks = math.lcm(tp * pp * cp, etp * ep * pp)
    recipe = {
        "run_dir": str(tmp_path / "run"),
        "platform": {"device": "cuda", "backend": "nccl"},
        "roles": {"groups": [
            {"roles": ["train", "logp", "ref"], "num_ranks": ranks},
            {"roles": ["generate"], "num_ranks": 1},
        ]},
        # a rollout batch of whole global batches (8 samples per prompt, the default)
        **({"rollout": {"num_prompts_per_step": max(1, _size(argv, "--global-batch-size") // 8)}}
           if "--grpo-prompts-per-step" not in argv else {}),
        # what Megatron-LM reads from elsewhere: the vocabulary (its tokenizer; here the HF
        # checkpoint, absent in a dry run) and, for model-only blocks (modelopt's conf/), the LR
        "megatron": {"vocab_size": 151936, **({} if "--lr" in argv else {"lr": 1.0e-6})},
    }  # fmt: skip
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path, ranks + 1
