"""Megatron-LM's own example flag blocks dry-run as they are.

Contract: the flags of Megatron-LM's example scripts (`tests/data/megatron_lm_examples/*.args`,
quoted from Megatron-LM with shell variables expanded), given after `--` to the real entry point
with `--dry-run`, exit 0 with at most one warning line listing the flags ignored and why. The
recipe only places the roles (one window holds train, logp and ref, sized for the example's
TP/PP/CP/EP; one rank generates) and gives what Megatron-LM reads from elsewhere: the vocabulary
(its tokenizer), a learning rate for model-only blocks, a rollout batch of whole global batches.
The RL model configs follow the fixed flags of Megatron-LM's RL launch command, as there.
Nothing is faked: `train.main` resolves, plans the layout and the memory as on a cluster.
"""

from __future__ import annotations

import logging

import pytest

from megatron_async_rl import train
from megatron_async_rl.config.errors import warn_once
from megatron_async_rl.config.megatron import inventory
from tests.harness.megatron_lm_examples import EXAMPLES, example_argv, example_recipe

pytestmark = pytest.mark.skipif(
    inventory.release_tag() != "core_v0.16.1",
    reason="the core_v0.16.1 blocks (other releases: test_megatron_lm_examples_by_release.py)",
)
NOT_BUILT = {
    "mamba_800m": "hybrid Mamba models (pretrain_mamba.py) are not built by this trainer",
    "rl_nemotron5_8b": "hybrid Mamba models (--hybrid-override-pattern) are not built here",
    "rl_nemotron6_3b_moe": "its architecture comes from the checkpoint (--use-checkpoint-args); "
    "here from model.hf_path's config.json, absent in this test",
}
RL_LAUNCHER = EXAMPLES / "rl_launcher.flags"
"""The fixed flags of examples/rl/README.md's launch command, which precede every RL model
config (rl_*.args) on Megatron-LM's own command line."""


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.args")))
def test_example_flags_dry_run(name, tmp_path, capsys):
    if name in NOT_BUILT:
        pytest.skip(NOT_BUILT[name])
    argv = example_argv(EXAMPLES / f"{name}.args")
    if name.startswith("rl_"):
        argv = example_argv(RL_LAUNCHER) + argv
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
    err = capsys.readouterr().err
    assert code == 0, err
    ignored = [line for line in err.splitlines() if "ignored, as they mean nothing" in line]
    assert len(ignored) <= 1, ignored
    if any(flag in argv for flag in ("--data-path", "--mock-data", "--tokenizer-type")):
        assert len(ignored) == 1  # the line is there (and on stderr, where a user reads it)
        with capsys.disabled():
            print(f"\n{name}: {len(argv)} args; {ignored[0][:160]}...")
