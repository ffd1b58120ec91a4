"""The recipe's reward model: a one-label sequence classifier with the policy's tokenizer.

Contracts: `build_config` accepts a `reward_model` role whose `reward_model.hf_path` is a tiny
`LlamaForSequenceClassification` written with the policy's tokenizer (its args resolved from its
own checkpoint), and refuses, in one line naming `reward_model.hf_path`, a causal LM (no score
head) and a classifier whose tokenizer differs from `model.hf_path`'s; through the command line
the refusal is exit 2. Real tiny checkpoints, nothing faked.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.models.tiny import write_tiny_model
from megatron_async_rl.recipe.load import build_config


def _tree(policy, rm) -> dict:
    return {
        "run_dir": "runs/rm", "platform": {"device": "cpu", "backend": "gloo"},
        "model": {"hf_path": str(policy)},
        "roles": {"groups": [{"roles": ["train", "logp", "ref", "reward_model"], "num_ranks": 1},
                             {"roles": ["generate"], "num_ranks": 1}]},
        "reward_model": {"hf_path": str(rm), "weight": 0.5},
        "megatron": {"lr": 1.0e-5, "transformer_impl": "local"},
    }  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    policy = write_tiny_model(root / "policy", "llama", seed=0)
    rm = write_tiny_model(root / "rm", "llama", seed=1, task="sequence_classification")
    other = write_tiny_model(root / "other", "llama", seed=1, task="sequence_classification")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["<extra>"] = len(tokenizer["model"]["vocab"])
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    return policy, rm, other


def test_a_reward_model_of_the_policys_tokenizer_resolves(models, tmp_path):
    policy, rm, _ = models
    cfg = build_config(_tree(policy, rm), [])
    assert cfg.reward_model.weight == 0.5
    assert cfg.role_megatron_args["reward_model"]["num_layers"] == 2
    # the same tokenizer saved in another layout (e.g. by save_pretrained) is the same
    import shutil

    copy = shutil.copytree(rm, tmp_path / "rm-copy")
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer, indent=4, sort_keys=True))
    assert build_config(_tree(policy, copy), []).reward_model.hf_path == str(copy)


def test_a_causal_lm_is_no_reward_model(models):
    policy, _, _ = models
    with pytest.raises(ConfigError, match=r"reward_model.hf_path = .*: has no score head"):
        build_config(_tree(policy, policy), [])


def test_a_reward_model_of_another_tokenizer_is_refused_with_exit_2(models, tmp_path):
    policy, _, other = models
    with pytest.raises(ConfigError, match=r"reward_model.hf_path = .*: has another tokenizer"):
        build_config(_tree(policy, other), [])
    recipe = tmp_path / "rm.yaml"
    recipe.write_text(yaml.safe_dump(_tree(policy, other)))
    proc = subprocess.run([sys.executable, "-m", "megatron_async_rl.train", "--config",
                           str(recipe), "--dry-run", "--world-size", "2"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "has another tokenizer" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
