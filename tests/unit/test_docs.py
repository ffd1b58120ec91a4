"""The user documentation builds, covers every recipe key, and says nothing it cannot back.

Contracts checked: (1) `sphinx-build -W --keep-going -b html docs OUT` succeeds with no warning
(warnings are errors; a broken internal cross-reference is one), in seconds; (2) every recipe key
of the config dataclasses has a description (its attribute docstring); (3) the generated recipe
reference lists every key of the dataclass tree, walked here independently of the generator,
and the generated Megatron-LM flag table every argument of the installed inventory; (4) every
shell block in docs/ is run by a test (`COMMANDS_RUN`, each with the test that runs it) or marked
`needs-cluster`, `needs-gpu` or `needs-minutes` (docs/contributing.md); (5) every relative link
in README.md and docs/ resolves to a file of the repository, and every other link is a public
https URL (the form only: no network here). Nothing is faked; the documented dry run is run as
written.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))

import recipe_keys  # noqa: E402  (docs/_ext: the generator of the reference pages)

MARKS = ("needs-cluster", "needs-gpu", "needs-minutes")
"""Classes that mark a shell block the tests do not run (docs/contributing.md)."""

COMMANDS_RUN = {
    "bash scripts/test.sh": ".ci/run (the test command itself; test_ci_runs_the_test_command)",
    ".venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html": (
        "tests/unit/test_docs.py::test_the_site_builds_without_a_warning (output in tmp_path)"
    ),
    "python -m megatron_async_rl.train --config yaml_configs/moe-32gpu-grpo-async.yaml "
    "--dry-run --world-size 32 --ranks-per-node 8": (
        "tests/unit/test_docs.py::test_the_documented_dry_run_runs"
    ),
}
"""Every unmarked shell command of docs/, and the test that runs it."""

SHELL_LANGUAGES = ("bash", "console", "shell", "sh")
BUILD_SECONDS = 120


def _markdown_files() -> list[Path]:
    files = [ROOT / "README.md"]
    files += sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    return files


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
    assert not result.stderr.strip(), f"sphinx-build warned:\n{result.stderr}"
    assert elapsed < BUILD_SECONDS, f"the docs build took {elapsed:.0f} s"
    return out


def test_the_site_builds_without_a_warning(site):
    assert (site / "index.html").is_file()
    assert (site / "reference" / "recipe.html").is_file()


# -- the recipe reference -------------------------------------------------------------------


def _independent_paths(cls: type, prefix: str = "") -> list[str]:
    """Every key under `cls`, from dataclasses.fields and the resolved type hints alone."""
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    paths = []
    for field in dataclasses.fields(cls):
        if not field.init or field.name.startswith("_"):
            continue
        path = prefix + field.name
        paths.append(path)
        hint = hints[field.name]
        candidates = [hint, *typing.get_args(hint)]
        for candidate in candidates:
            listed = typing.get_origin(candidate) is list
            inner = typing.get_args(candidate)[0] if listed else candidate
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                paths += _independent_paths(inner, f"{path}[]." if listed else f"{path}.")
                break
    return paths


def test_the_schema_is_imported_from_where_it_lives():
    assert dataclasses.is_dataclass(recipe_keys.schema_module().RunConfig)


def test_every_recipe_key_has_a_description():
    missing = [key.path for key in recipe_keys.walk() if not key.description.strip()]
    assert not missing, (
        "recipe keys without a description (add an attribute docstring under the field): "
        + ", ".join(missing)
    )


def test_the_reference_covers_every_recipe_key(site):
    expected = _independent_paths(recipe_keys.run_config_class())
    assert len(expected) > 150  # the whole tree, not the top level
    page = (site / "reference" / "recipe.html").read_text()
    listed = re.findall(r'<tr class="row-(?:odd|even)"><td><p><code[^>]*><span class="pre">'
                        r"([^<]+)</span>", page)  # fmt: skip
    assert sorted(listed) == sorted(expected)
    for key in recipe_keys.walk():
        if key.choices:
            for choice in key.choices:
                assert f'<span class="pre">{choice}</span>' in page, (key.path, choice)


def test_the_flag_table_lists_every_megatron_lm_argument(site):
    import recipe_reference

    tag, _, rows = recipe_reference.megatron_flag_rows()
    page = (site / "reference" / "megatron-flags.html").read_text()
    assert tag in page
    assert len(rows) > 600
    missing = [f[0] for _, f, _, _ in rows if f'<span class="pre">{f[0]}</span>' not in page]
    assert not missing, missing
    assert not [dest for *_, dest, verdict in rows if verdict.kind == "unknown"]


# -- shell blocks ---------------------------------------------------------------------------


def _fenced_blocks(text: str):
    """(info string, option lines, body lines) of every top-level fenced block."""
    lines = text.split("\n")
    index = 0
    while index < len(lines):
        match = re.match(r"^( *)(`{3,}|~{3,})(.*)$", lines[index])
        if not match:
            index += 1
            continue
        indent, fence, info = match.groups()
        body = []
        index += 1
        while index < len(lines):
            close = lines[index].strip()
            if close.startswith(fence[0] * len(fence)) and set(close) == {fence[0]}:
                break
            body.append(lines[index][len(indent):] if lines[index].startswith(indent) else
                        lines[index])  # fmt: skip
            index += 1
        index += 1
        options = []
        while body and re.match(r"^:[\w-]+:", body[0]):
            options.append(body.pop(0))
        yield info.strip(), options, body


def _shell_language(info: str) -> str | None:
    match = re.match(r"^\{code-block\}\s+(\S+)$", info) or re.match(r"^(\S+)$", info)
    if match and match.group(1) in SHELL_LANGUAGES:
        return match.group(1)
    return None


def _commands(body: list[str]) -> list[str]:
    """The commands of a block: continuation lines joined, comments and blanks dropped."""
    joined, current = [], ""
    for line in body:
        line = line.rstrip()
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        current += line.strip()
        if current:
            joined.append(current)
        current = ""
    out = []
    for command in joined:
        command = command.removeprefix("$ ")
        words = shlex.split(command, comments=True)
        if words:
            out.append(" ".join(words))
    return out


def test_every_shell_block_is_run_by_a_test_or_marked():
    problems = []
    for path in _markdown_files():
        if path.parent == ROOT:
            continue  # README.md: its two commands are getting-started.md's
        for info, options, body in _fenced_blocks(path.read_text()):
            if _shell_language(info) is None:
                continue
            classes = {c for o in options if o.startswith(":class:") for c in o.split()[1:]}
            if classes & set(MARKS):
                continue
            for command in _commands(body):
                if command not in COMMANDS_RUN:
                    problems.append(f"{path.relative_to(ROOT)}: {command}")
    assert not problems, (
        "shell commands neither in COMMANDS_RUN nor marked "
        + "/".join(MARKS)
        + ":\n"
        + "\n".join(problems)
    )


def test_the_command_list_holds_only_documented_commands():
    documented = set()
    for path in _markdown_files():
        for info, _, body in _fenced_blocks(path.read_text()):
            if _shell_language(info):
                documented.update(_commands(body))
    assert set(COMMANDS_RUN) <= documented, set(COMMANDS_RUN) - documented


def test_ci_runs_the_test_command():
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "```bash\nbash scripts/quickstart.sh\n```" in readme
    assert "```bash\nbash scripts/test.sh\n```" in readme


def test_the_documented_dry_run_runs():
    command = next(c for c in COMMANDS_RUN if "--dry-run" in c)
    argv = shlex.split(command)
    assert argv[0] == "python"
    result = subprocess.run(
        [sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "valid for 32 ranks" in result.stdout
    assert "nodes: 4 x 8 ranks (no engine spans two)" in result.stdout


# -- links ----------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_AUTOLINK = re.compile(r"<((?:https?|ftp|file)://[^>\s]+)>")


def _prose(text: str) -> str:
    """The text outside fenced blocks and inline code."""
    out, fence = [], None
    for line in text.split("\n"):
        match = re.match(r"^ *(`{3,}|~{3,})", line)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            if line.strip() and set(line.strip()) == {fence[0]} and len(line.strip()) >= len(fence):
                fence = None
            continue
        out.append(re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return "\n".join(out)


def test_links_resolve_inside_the_repository_or_are_public_https():
    problems = []
    for path in _markdown_files():
        text = _prose(path.read_text())
        targets = _LINK.findall(text) + _AUTOLINK.findall(text)
        for target in targets:
            where = f"{path.relative_to(ROOT)}: {target}"
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                if not target.startswith("https://") or re.match(
                    r"^https://(localhost|127\.|10\.|192\.168\.)", target
                ):
                    problems.append(f"{where} (external links must be public https URLs)")
                continue
            file_part = target.split("#", 1)[0]
            if not file_part:
                continue  # an anchor on the same page
            resolved = (path.parent / file_part).resolve()
            if ROOT not in resolved.parents and resolved != ROOT:
                problems.append(f"{where} (leaves the repository)")
            elif not resolved.exists():
                problems.append(f"{where} (no such file)")
    assert not problems, "\n".join(problems)


def test_readme_is_short_and_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", readme))
    assert {"docs/getting-started.md", "docs/troubleshooting.md", "docs/known-limits.md"} <= linked


def test_every_page_is_reachable_from_the_index(site):
    pages = {
        p.relative_to(DOCS).with_suffix("").as_posix()
        for p in DOCS.rglob("*.md")
        if "_build" not in p.parts and p.name != "README.md"
    }
    missing = [page for page in pages if not (site / f"{page}.html").is_file()]
    assert not missing, missing
