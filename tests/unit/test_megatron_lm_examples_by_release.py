"""Megatron-LM's own example flag blocks of the installed release series dry-run as they are.

Contract: the flags of Megatron-LM's example scripts at the tag of the installed megatron-core
(`tests/data/megatron_lm_examples/<tag>/*.args`, recorded from the scripts with their shell
variables expanded; the RL model configs after the launch command's fixed flags,
`rl_launcher.flags`), given after `--` to the real entry point with `--dry-run`, exit 0 with at
most one warning line listing the flags ignored and why; a block that asks for what is not built
here, or that Megatron-LM's own parser rejects at that tag, exits 2 with the error named in
`REFUSED` (each checked against Megatron-LM's parser when the block was recorded: see the
folder's README). The recipe is `test_megatron_lm_examples._recipe`'s (roles placed for the
block's TP/PP/CP/EP, the vocabulary and, for model-only blocks, a learning rate). Nothing is
faked: `train.main` resolves, plans the layout and the memory as on a cluster. The core_v0.16.1
blocks (the folder's top level) are `test_megatron_lm_examples.py`'s.
"""

from __future__ import annotations

import logging
import re

import pytest

from megatron_async_rl import train
from megatron_async_rl.config.errors import warn_once
from megatron_async_rl.config.megatron import inventory
from tests.harness.megatron_lm_examples import EXAMPLES, example_argv, example_recipe

TAG = inventory.release_tag()
BLOCKS = EXAMPLES / TAG
REFUSED = {
    "core_v0.19.0": {
        # Megatron-LM's own parser rejects these blocks at core_v0.19.0 too
        "gpt3_175b": r"--step-batch-size-schedule = '0:16': Megatron-LM's batch-size schedule "
        r"is not applied here(.|\n)*megatron flags = '2.4B:320': expected a --flag",
        "gptoss_20b": r"--export-force-local-attention: unknown Megatron flag",
        "modelopt_gpt_oss_20b": r"--export-force-local-attention: unknown Megatron flag",
        "rl_nemotron5_56b": r"--model-temperature: unknown Megatron flag",
        "rl_qwen3_30b_a3b_moe": r"--tokenizer-hf-include-special-tokens: unknown Megatron flag",
        # what is not built here
        "mamba_800m": r"hybrid Mamba models are not built here",
        "rl_qwen_2p5_distill_7b": r"--ckpt-format = 'torch': checkpoints here are megatron-core "
        r"dist_checkpointing in torch_dist format",
        "rl_qwen_2p5_math_7b": r"--ckpt-format = 'torch': checkpoints here are megatron-core "
        r"dist_checkpointing",
        # its architecture comes from the checkpoint (--use-checkpoint-args); here from
        # model.hf_path's config.json, absent in this test
        "rl_nemotron6_3b_moe": r"--hidden-size = None: is required",
        "rl_nemotron5_8b": r"hybrid Mamba models are not built here",
        "rl_nemotron5p5_12b_h": r"hybrid Mamba models are not built here",
    },
}
"""Block -> the error its dry run reports (a regular expression)."""


def _dry_run(argv: list[str], tmp_path, capsys) -> tuple[int, str]:
    recipe, world_size = example_recipe(tmp_path, argv)
    warn_once.cache_clear()  # once per process: every example is a fresh run
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # train.main sets up logging on capsys' stderr
    try:
        code = train.main(
            ["--config", str(recipe), "--dry-run", "--world-size", str(world_size), "--", *argv]
        )
    except SystemExit as stop:
        code = stop.code
    finally:
        root.handlers[:], root.level = handlers, level
    return code, capsys.readouterr().err


@pytest.mark.skipif(not BLOCKS.is_dir(), reason=f"no example blocks recorded for {TAG}")
@pytest.mark.parametrize("name", sorted(p.stem for p in BLOCKS.glob("*.args")))
def test_example_flags_dry_run(name, tmp_path, capsys):
    argv = example_argv(BLOCKS / f"{name}.args")
    if name.startswith("rl_"):
        argv = example_argv(BLOCKS / "rl_launcher.flags") + argv
    code, err = _dry_run(argv, tmp_path, capsys)
    refused = REFUSED.get(TAG, {}).get(name)
    if refused is not None:
        assert code == 2 and re.search(refused, err), err
        return
    assert code == 0, err
    ignored = [line for line in err.splitlines() if "ignored, as they mean nothing" in line]
    assert len(ignored) <= 1, ignored
    if any(flag in argv for flag in ("--data-path", "--mock-data", "--tokenizer-type")):
        assert len(ignored) == 1  # the line is there (and on stderr, where a user reads it)
        with capsys.disabled():
            print(f"\n{TAG} {name}: {len(argv)} args; {ignored[0][:160]}...")
