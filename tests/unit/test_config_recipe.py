"""Recipe loading and resolution (`recipe/load.py`, `recipe/schema.py`, `config/errors.py`).

Contract: `resolve(path, sets, megatron_argv)` = `load_recipe` -> `apply_overrides` (`--set`)
-> `build_config`; each Megatron role's args resolve as defaults < the architecture in
`model.hf_path`'s config.json < `megatron:` < `roles.<role>.megatron:` < flags after `--`;
`write_resolved` writes YAML that reads back to an equal config; the shipped recipes
`yaml_configs/tiny-cpu*.yaml` resolve and lay out as documented. Faked: the HF directory is a
hand-written llama `config.json` plus an empty `model.safetensors` (only its existence is read).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from megatron_async_rl.config.errors import ConfigError, exit_on_config_error
from megatron_async_rl.recipe.load import build_config, resolve
from megatron_async_rl.recipe.schema import (
    ModelConfig,
    ResolvedConfig,
    RoleGroupSpec,
    RolesConfig,
    RunConfig,
)
from megatron_async_rl.recipe.tree import apply_overrides, load_recipe, to_tree, write_resolved

REPO_ROOT = Path(__file__).resolve().parents[2]
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 96,
    "hidden_act": "silu",
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A working directory holding a fake runs/tiny-llama and the shipped recipes."""
    model = tmp_path / "runs" / "tiny-llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(LLAMA))
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_tiny_cpu_recipe(workdir):
    cfg = resolve(REPO_ROOT / "yaml_configs" / "tiny-cpu.yaml", [], [])
    assert cfg.model.hf_path == "runs/tiny-llama"
    train, logp = cfg.role_megatron_args["train"], cfg.role_megatron_args["logp"]
    assert (train["tensor_model_parallel_size"], logp["tensor_model_parallel_size"]) == (2, 1)
    # architecture from config.json, recipe values on top
    assert (train["hidden_size"], train["num_query_groups"], train["swiglu"]) == (64, 2, True)
    assert (train["lr"], train["micro_batch_size"], train["bf16"]) == (1e-5, 2, False)
    layout = cfg.plan_layout(4)
    assert [(w.roles, w.offset, w.size) for w in layout.windows] == [
        (("train",), 0, 2),
        (("logp",), 2, 1),
        (("ref",), 3, 1),
    ]


def test_tiny_cpu_two_rank_recipe(workdir):
    cfg = resolve(REPO_ROOT / "yaml_configs" / "tiny-cpu-2rank.yaml", [], [])
    layout = cfg.plan_layout(2)
    assert layout.roles_of_rank(0) == ("logp", "train") and layout.roles_of_rank(1) == ("ref",)


def test_precedence(workdir):
    recipe = _recipe(
        workdir / "r.yaml",
        "model: {hf_path: runs/tiny-llama}\n"
        "roles:\n"
        "  groups: [{roles: [train, logp, ref], num_ranks: 1}]\n"
        "  train: {megatron: {lr: 3.0e-5, hidden_dropout: 0.2}}\n"
        "megatron: {lr: 1.0e-5, hidden_dropout: 0.1, init_method_std: 0.5,\n"
        "           attention_dropout: 0.05}\n",
    )
    cfg = resolve(recipe, ["megatron.init_method_std=0.25"], ["--hidden-dropout", "0.3"])
    train, ref = cfg.role_megatron_args["train"], cfg.role_megatron_args["ref"]
    assert train["attention_dropout"] == 0.05  # recipe beats config.json (0.0)
    assert ref["num_layers"] == 2  # config.json beats the default (None)
    assert (train["lr"], ref["lr"]) == (3e-5, 1e-5)  # role override beats shared
    assert ref["init_method_std"] == 0.25  # --set beats recipe
    assert train["hidden_dropout"] == ref["hidden_dropout"] == 0.3  # flags beat everything
    assert ref["weight_decay"] == 0.01  # megatron-core default


def test_apply_overrides_paths():
    tree = {"roles": {"groups": [{"roles": ["train"], "num_ranks": 1}]}}
    apply_overrides(
        tree,
        [
            "smoke.batch_size=8",
            "roles.groups[0].num_ranks=2",
            "roles.groups.0.roles=[train, logp]",
            "roles.train.megatron.tensor-model-parallel-size=2",
            "platform.device=cpu",
            "model.hf_path=null",
            "run_dir=runs/a=b",
        ],
    )
    assert tree == {
        "roles": {
            "groups": [{"roles": ["train", "logp"], "num_ranks": 2}],
            "train": {"megatron": {"tensor-model-parallel-size": 2}},
        },
        "smoke": {"batch_size": 8},
        "platform": {"device": "cpu"},
        "model": {"hf_path": None},
        "run_dir": "runs/a=b",
    }
    with pytest.raises(
        ConfigError, match=r"--set = 'smoke.batch_size.x=1': smoke.batch_size is a value"
    ):
        apply_overrides(tree, ["smoke.batch_size.x=1"])
    with pytest.raises(ConfigError, match=r"roles.groups is a list: index it"):
        apply_overrides(tree, ["roles.groups.roles=[ref]"])


def test_write_resolved_round_trip(workdir):
    cfg = resolve(
        REPO_ROOT / "yaml_configs" / "tiny-cpu.yaml",
        ["smoke.batch_size=2", "roles.groups[1].roles=[logp]"],
        ["--lr", "2e-6", "--sequence-parallel"],
        run_dir_override="runs/override",
    )
    assert cfg.run_dir == "runs/override"
    path = write_resolved(cfg, workdir / "runs" / "override" / "config.resolved.yaml")
    text = path.read_text()
    assert text.startswith("# Resolved config") and "tensor_model_parallel_size=2" in text
    again = build_config(load_recipe(path), [])
    assert again == cfg
    assert again.role_megatron_args == cfg.role_megatron_args
    assert to_tree(again) == to_tree(cfg)


def test_flags_are_folded_into_every_role(workdir):
    cfg = resolve(REPO_ROOT / "yaml_configs" / "tiny-cpu.yaml", [], ["--lr", "2e-6"])
    assert cfg.roles.megatron["train"] == {"tensor_model_parallel_size": 2, "lr": 2e-6}
    assert cfg.roles.megatron["ref"] == {"lr": 2e-6}
    assert cfg.megatron["lr"] == 1e-5


def test_schema_dataclasses_direct():
    roles = RolesConfig(
        groups=[RoleGroupSpec(["train", "logp"], num_ranks=1), RoleGroupSpec(["ref"], ratio=1)],
        megatron={"train": {"tensor-model-parallel-size": 1}},
    )
    assert roles.megatron == {"train": {"tensor_model_parallel_size": 1}}
    assert roles.groups[1].ratio == 1.0 and roles.placed_roles() == ("train", "logp", "ref")
    run = RunConfig(roles=roles, megatron={"no-bf16": True})
    assert run.megatron == {"bf16": False} and run.model == ModelConfig(None)
    with pytest.raises(
        ConfigError, match=r"^config error: ratio = 1.5: must be a finite number in \(0, 1\]$"
    ):
        RoleGroupSpec(["train"], ratio=1.5)
    with pytest.raises(ConfigError, match=r"num_ranks = True: must be an integer >= 1"):
        RoleGroupSpec(["train"], num_ranks=True)


def test_resolved_config_is_a_run_config(workdir):
    cfg = resolve(REPO_ROOT / "yaml_configs" / "tiny-cpu.yaml", [], [])
    assert isinstance(cfg, ResolvedConfig) and isinstance(cfg, RunConfig)
    assert type(cfg.run_config()) is RunConfig and cfg.run_config().roles == cfg.roles


def test_empty_and_non_mapping_recipes(tmp_path):
    assert load_recipe(_recipe(tmp_path / "empty.yaml", "")) == {}
    with pytest.raises(ConfigError, match=r"a recipe must be a YAML mapping at the top"):
        load_recipe(_recipe(tmp_path / "list.yaml", "- 1\n"))
    with pytest.raises(ConfigError, match=r"is a directory, not a recipe file"):
        load_recipe(tmp_path)
    with pytest.raises(ConfigError, match=r"^config error: smoke = 3: must be a mapping$"):
        build_config(
            {
                "smoke": 3,
                "roles": {"groups": [{"roles": ["train", "logp", "ref"], "num_ranks": 1}]},
            },
            [],
        )
    with pytest.raises(ConfigError, match=r"^config error: roles.groups = \[\]: must be a non-emp"):
        build_config({"roles": {"groups": []}}, [])


def test_hf_path_checks(workdir):
    (workdir / "runs" / "tiny-llama" / "model.safetensors").unlink()
    tree = {
        "model": {"hf_path": "runs/tiny-llama"},
        "roles": {"groups": [{"roles": ["train", "logp", "ref"], "num_ranks": 1}]},
    }
    with pytest.raises(
        ConfigError, match=r"model.hf_path = 'runs/tiny-llama': has no \*.safetensors"
    ):
        build_config(tree, [])
    (workdir / "runs" / "tiny-llama" / "model.safetensors").write_bytes(b"")
    (workdir / "runs" / "tiny-llama" / "config.json").write_text(
        json.dumps({**LLAMA, "hidden_act": "gelu"})
    )
    with pytest.raises(
        ConfigError, match=r"model.hf_path = 'runs/tiny-llama': config.json: unsupported"
    ):
        build_config(tree, [])


def test_config_error_format_and_pickling():
    err = ConfigError("groups[1].num_ranks", 3, "rank counts must sum to 4 (got 5)", "fix it")
    assert (
        str(err)
        == "config error: groups[1].num_ranks = 3: rank counts must sum to 4 (got 5); hint: fix it"
    )
    assert str(err.with_prefix("roles")).startswith("config error: roles.groups[1].num_ranks = 3:")
    assert err.with_prefix("roles").key == "roles.groups[1].num_ranks"
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.key, copy.value, copy.rule, copy.hint, str(copy)) == (
        err.key,
        3,
        err.rule,
        "fix it",
        str(err),
    )
    long = ConfigError("k", "x" * 500 + "\nmore", "bad")
    assert "\n" not in str(long) and len(str(long)) < 150


def test_exit_on_config_error_passes_results_through(capsys):
    assert exit_on_config_error(lambda a, b=0: a + b, 1, b=2) == 3
    with pytest.raises(SystemExit) as info:
        exit_on_config_error(load_recipe, "/nonexistent/recipe.yaml")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: config error: --config = '/nonexistent/recipe.yaml'")
        and err.count("\n") == 1
    )


def test_collective_timeout_is_derived_from_the_stage_timeout(workdir):
    """Issue 14, item 5: every process group's timeout comes from `scheduler.stage_timeout_s`
    unless Megatron's --distributed-timeout-minutes or platform.timeout_s sets it; two keys
    that disagree are refused, naming both."""
    tiny = REPO_ROOT / "yaml_configs" / "tiny-cpu.yaml"
    cfg = resolve(tiny, ["scheduler.stage_timeout_s=45"], [])
    assert cfg.collective_timeout_s() == (45.0, "scheduler.stage_timeout_s")
    cfg = resolve(tiny, [], ["--distributed-timeout-minutes", "3"])
    assert cfg.collective_timeout_s() == (180.0, "--distributed-timeout-minutes")
    cfg = resolve(tiny, ["platform.timeout_s=90"], [])
    assert cfg.collective_timeout_s() == (90.0, "platform.timeout_s")
    with pytest.raises(ConfigError, match=r"platform.timeout_s = 90.*--distributed-timeout"):
        resolve(tiny, ["platform.timeout_s=90"], ["--distributed-timeout-minutes", "3"])
    with pytest.raises(ConfigError, match="timeout_s"):
        resolve(tiny, ["platform.timeout_s=-1"], [])


def test_flags_cannot_change_the_checkpoint_architecture(workdir):
    """model.hf_path defines the architecture the engines build: a Megatron arg that changes it
    (or adds a feature the HF config has no word for) is refused, naming the flag."""
    recipe = _recipe(
        workdir / "r.yaml",
        "model: {hf_path: runs/tiny-llama}\n"
        "roles:\n"
        "  groups: [{roles: [train, logp, ref], num_ranks: 1}]\n"
        "megatron: {lr: 1.0e-5}\n",
    )
    differs = r"--rotary-base = 10: differs from model.hf_path's config.json \(\d+(\.\d+)?; role"
    with pytest.raises(ConfigError, match=differs + r" train\): the engines build that"):
        resolve(recipe, [], ["--rotary-base", "10"])
    with pytest.raises(ConfigError, match="--use-rope-scaling = True: model.hf_path's config.json "
                       "has no such feature"):  # fmt: skip
        resolve(recipe, [], ["--use-rope-scaling"])
    resolve(recipe, [], ["--attention-dropout", "0.1"])  # training knobs stay free
