"""Every wrong recipe, `--set` or Megatron flag a user can give is reported as one ConfigError.

Contract: for each case of the corpus in `bad_inputs/cases.yaml` (recipe files in the same
folder), `resolve` (and `plan_layout` for layout cases) raises `ConfigError` whose one-line
message names the key or flag, the value received, and the rule broken. Through
`exit_on_config_error` a user sees exit status 2 and a single `error:` line on stderr, no
traceback (checked in a subprocess for four cases). Nothing is faked; no process group is made.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.megatron import table
from megatron_async_rl.recipe.load import resolve

CORPUS = Path(__file__).parent / "bad_inputs"
REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = yaml.safe_load((CORPUS / "cases.yaml").read_text())


def _pattern(case: dict) -> str:
    where = case["key"] if "value" not in case else f"{case['key']} = {case['value']}"
    return re.escape(where) + ": " + case["rule"]


def test_corpus_is_large_and_every_file_is_used():
    assert len(CASES) >= 18
    assert len({case["id"] for case in CASES}) == len(CASES), "case ids must be unique"
    used = {case["recipe"] for case in CASES}
    on_disk = {p.name for p in CORPUS.glob("*.yaml")} - {"cases.yaml"}
    assert on_disk <= used, f"recipes without a case: {sorted(on_disk - used)}"


def test_good_recipe_resolves(monkeypatch):
    monkeypatch.chdir(CORPUS)
    cfg = resolve("good.yaml", [], [])
    assert cfg.plan_layout(4).window_of("train").size == 2


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_bad_input_is_a_config_error(case, monkeypatch):
    monkeypatch.chdir(CORPUS)
    with pytest.raises(ConfigError, match=_pattern(case)) as info:
        cfg = resolve(case["recipe"], case.get("sets", []), case.get("flags", []))
        if "world_size" in case:
            cfg.plan_layout(case["world_size"])
    err = info.value
    assert err.key == case["key"]
    message = str(err)
    assert message.startswith("config error: ") and "\n" not in message


SUBPROCESS_CASES = ["missing_file", "malformed_yaml", "misspelt_roles_key", "unknown_flag"]


@pytest.fixture(scope="module")
def flag_cache_env(tmp_path_factory):
    """An environment whose flag cache is warm, so the child need not import megatron-core."""
    cache_dir = tmp_path_factory.mktemp("flag_cache")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), MEGATRON_ASYNC_RL_CACHE_DIR=str(cache_dir))
    previous = os.environ.get(table.CACHE_DIR_ENV)
    os.environ[table.CACHE_DIR_ENV] = str(cache_dir)
    try:
        assert table.warm_flag_cache() is not None
    finally:
        if previous is None:
            del os.environ[table.CACHE_DIR_ENV]
        else:
            os.environ[table.CACHE_DIR_ENV] = previous
    return env


@pytest.mark.parametrize("case_id", SUBPROCESS_CASES)
def test_cli_reports_one_line_and_exit_code_2(case_id, flag_cache_env):
    case = next(c for c in CASES if c["id"] == case_id)
    code = (
        "import sys\n"
        "from megatron_async_rl.config.errors import exit_on_config_error\n"
        "from megatron_async_rl.recipe.load import resolve\n"
        f"exit_on_config_error(resolve, {case['recipe']!r}, {case.get('sets', [])!r}, "
        f"{case.get('flags', [])!r})\n"
        "sys.exit(0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=CORPUS,
        env=flag_cache_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: config error: ")
    assert re.search(_pattern(case), lines[0])
