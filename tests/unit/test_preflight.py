"""The dry run checks what a run reads, before any rank or engine: the new user's mistakes.

Contract: `python -m megatron_async_rl.train --config R --dry-run --here` on the quick-start
recipe with one mistake each (a misspelt reward, a missing plugin module, a reward whose
signature breaks the contract, a missing data file, --bf16 on CPU, an environment or tool that
does not import, a malformed tool spec, an argument the environment does not take, nan or inf
for a float flag) exits 2 with one `error:`
line naming the key or flag, the value and the rule; so does a --global-batch-size that the
train role's micro-batches and data-parallel size cannot split; the recipe as it is passes.
Nothing is faked: the real entry point in this process, the real tokenizer and dataset readers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from megatron_async_rl import train

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    data = root / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    (root / "bad_reward_plugin.py").write_text(
        "def score(prompt, response, answer=None, **kw):\n    return 1.0\n"
    )
    (root / "my_env_plugin.py").write_text(
        "class Env:\n    def __init__(self, limit: int = 3):\n        self.limit = limit\n"
        "    def reset(self, sample):\n        return []\n"
        "    def step(self, action):\n        return None\n"
    )
    recipe = yaml.safe_load((REPO / "yaml_configs" / "tiny-grpo-cpu.yaml").read_text())
    recipe["model"]["hf_path"] = str(tiny_model("llama"))
    recipe["data"]["path"] = str(data)
    recipe["run_dir"] = str(root / "run")
    return root, recipe


def _dry_run(root, recipe, monkeypatch, capsys, *args):
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.syspath_prepend(str(root))
    root_logger = logging.getLogger()
    handlers, level = root_logger.handlers[:], root_logger.level
    try:
        code = train.main(["--config", str(path), "--dry-run", "--here", "--world-size", "2",
                           *args])  # fmt: skip
    except SystemExit as stop:
        code = stop.code
    finally:
        root_logger.handlers[:], root_logger.level = handlers, level
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    return code, errors


@pytest.mark.parametrize(
    "change, args, expected",
    [
        ({"reward": {"name": "arithmetc"}}, [],
         "reward.name = 'arithmetc': unknown reward name; hint: did you mean arithmetic?"),
        ({"reward": {"name": "no_such_plugin_xyz:score"}}, [],
         "reward.name = 'no_such_plugin_xyz:score': cannot import module"),
        ({"reward": {"name": "bad_reward_plugin:score"}}, [],
         "reward.name = 'bad_reward_plugin:score': reward takes (prompt, response, answer=None, "
         "**kw); the contract is fn(response_text, answer, metadata) -> float"),
        ({"data": {"path": "missing/train.jsonl"}}, [],
         "data.path = 'missing/train.jsonl': file not found"),
        ({}, ["--", "--bf16"], "--bf16 = True: is not supported on CPU"),
        ({}, ["--", "--global-batch-size", "64", "--micro-batch-size", "48"],
         "--global-batch-size = 64: --global-batch-size must be a multiple of the micro-batch "
         "size x data-parallel size = 48 x 1 = 48"),
        ({"environment": {"name": "no_such_env_xyz:Env"}}, [],
         "environment.name = 'no_such_env_xyz:Env': cannot import it: No module named "
         "'no_such_env_xyz'"),
        ({"environment": {"name": "tools", "tools": ["megatron_async_rl.tasks.calculator:nosuch"]}},
         [], "environment.tools[0] = 'megatron_async_rl.tasks.calculator:nosuch': cannot import "
         "it: module 'megatron_async_rl.tasks.calculator' has no attribute 'nosuch'"),
        ({"environment": {"name": "tools", "tools": ["notaspec"]}}, [],
         "environment.tools[0] = 'notaspec': must be module:function or a function"),
        ({"environment": {"name": "my_env_plugin:Env", "kwargs": {"bogus": 1}}}, [],
         "environment.kwargs = {'bogus': 1}: my_env_plugin:Env does not take them: got an "
         "unexpected keyword argument 'bogus'"),
        ({}, ["--", "--lr", "nan"], "--lr = 'nan': must be a finite number"),
        ({"megatron": {"clip_grad": float("inf")}}, [], "megatron.clip_grad = inf: must be a "
         "finite number"),
    ],
    ids=["misspelt-reward", "missing-plugin", "wrong-signature", "missing-data", "bf16-on-cpu",
         "global-batch", "missing-environment", "missing-tool", "malformed-tool",
         "environment-kwargs", "nan-flag", "inf-in-recipe"],
)  # fmt: skip
def test_a_mistake_is_one_line_and_exit_2(setup, monkeypatch, capsys, change, args, expected):
    root, recipe = setup
    recipe = {**recipe, **{k: {**recipe.get(k, {}), **v} for k, v in change.items()}}
    code, errors = _dry_run(root, recipe, monkeypatch, capsys, *args)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(f"error: config error: {expected}"), errors[0]


def test_the_dry_run_checks_g_as_decrease_batch_size_if_needed_rounds_it(
    setup, monkeypatch, capsys
):
    root, recipe = setup
    recipe = {**recipe, "rollout": {**recipe["rollout"], "num_prompts_per_step": 12}}  # B = 96
    flags = ["--", "--global-batch-size", "48", "--micro-batch-size", "32"]
    code, errors = _dry_run(root, recipe, monkeypatch, capsys, *flags)
    assert code == 2 and "must be a multiple of the micro-batch size" in errors[0], errors
    # rounded down to 32, which divides the rollout batch of 96
    code, errors = _dry_run(root, recipe, monkeypatch, capsys, *flags,
                            "--decrease-batch-size-if-needed")  # fmt: skip
    assert (code, errors) == (0, [])


def test_the_recipe_as_it_is_passes(setup, monkeypatch, capsys):
    root, recipe = setup
    code, errors = _dry_run(root, recipe, monkeypatch, capsys)
    assert code == 0 and not errors


def test_a_held_out_set_is_checked_only_when_validation_is_on(setup, monkeypatch, capsys):
    root, recipe = setup
    off = {**recipe, "validation": {"data": {"path": "missing/eval.jsonl"}},
           "scheduler": {"validation_every": 0}}  # fmt: skip
    assert _dry_run(root, off, monkeypatch, capsys) == (0, [])
    on = {**off, "scheduler": {"validation_every": 2}}
    code, errors = _dry_run(root, on, monkeypatch, capsys)
    assert code == 2 and errors == [
        "error: config error: validation.data.path = 'missing/eval.jsonl': file not found; hint: "
        "check the path (relative to the working dir)"
    ]


def test_the_sandboxed_tools_need_a_sandbox_that_runs(setup, monkeypatch, capsys):
    """`environment.tools: [python]` where bubblewrap cannot be had: one line, exit 2."""
    from megatron_async_rl.sandbox import run

    root, recipe = setup
    recipe = {**recipe, "environment": {"name": "tools", "tools": ["python"]}}
    monkeypatch.setattr(run, "find_bwrap", lambda: None)
    code, errors = _dry_run(root, recipe, monkeypatch, capsys)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].startswith(
        "error: config error: environment.tools = ['python']: the sandbox cannot run code on "
        "this machine: bubblewrap (bwrap) is not installed; hint: install bubblewrap"
    ), errors[0]
