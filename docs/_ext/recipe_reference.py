"""Sphinx extension: the generated reference pages, filled in when Sphinx reads them.

`reference/recipe.md` gets a table per recipe section of every key (`recipe_keys.walk`), and
`reference/megatron-flags.md` the verdict on every Megatron-LM flag of the installed
megatron-core's inventory (`megatron_flag_rows`). Each page holds a marker comment that the
`source-read` handler replaces, so the text around the tables stays hand-written.

The flag verdicts come from the flag classification module; the set of flags applied here from
the flag table, which derives most of them from megatron-core's config dataclasses once per
megatron-core release and version of the table module, and caches them on disk
(`$MEGATRON_ASYNC_RL_CACHE_DIR`, default `~/.cache/megatron_async_rl`). With that cache warm
(any run or test of the package fills it) the build imports no torch; with it cold, the first
build imports megatron-core once (seconds) and fills it.
"""

from __future__ import annotations

import importlib
import re
import warnings
from collections import Counter, defaultdict

import recipe_keys

GENERATED = ("reference/recipe", "reference/megatron-flags")
RECIPE_MARKER = "<!-- generated: recipe keys -->"
FLAGS_MARKER = "<!-- generated: megatron flags -->"

FLAG_VERDICTS = "megatron_async_rl.config.megatron.inventory"
"""The Megatron-LM flag inventories and the verdict on each flag (`release_tag`, `inventory`,
`lm_dests`, `classify`)."""
FLAG_TABLE = "megatron_async_rl.config.megatron.table"
"""The Megatron arguments built here (`flag_table`)."""


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes and HTML-looking text escaped outside code."""
    text = " ".join(str(text).split())
    parts = text.split("`")
    for index in range(0, len(parts), 2):  # outside code spans
        parts[index] = re.sub(r"([<*|\[\]])", r"\\\1", parts[index])
    for index in range(1, len(parts), 2):
        parts[index] = parts[index].replace("|", "\\|")
    return "`".join(parts)


def _code(text: str) -> str:
    text = str(text).replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"


def recipe_markdown() -> str:
    keys = recipe_keys.walk()
    sections: dict[str, list] = defaultdict(list)
    top = []
    for key in keys:
        head = key.path.split(".")[0].split("[")[0]
        if "." not in key.path and not key.section:
            top.append(key)
        else:
            sections[head].append(key)
    out = [
        f"{len(keys)} keys, read from `{recipe_keys.schema_module().__name__}.RunConfig` "
        "and the dataclasses of its fields.",
        "",
    ]
    groups = [("Top-level keys", top)] + [(f"`{name}:`", rows) for name, rows in sections.items()]
    for title, rows in groups:
        out += [f"## {title}", ""]
        out += [
            "| key | type | default | allowed | description |",
            "| --- | --- | --- | --- | --- |",
        ]
        for key in rows:
            allowed = ", ".join(_code(c) for c in key.choices) if key.choices else ""
            description = key.description or "(no description)"
            out.append(
                f"| {_code(key.path)} | {_code(key.type)} | {_code(key.default)} | {allowed} "
                f"| {_cell(description)} |"
            )
        out.append("")
    return "\n".join(out)


def megatron_flag_rows() -> tuple[str, str, list[tuple]]:
    """(inventory tag, Megatron-LM commit, rows of (group, flags, dest, verdict))."""
    verdicts = importlib.import_module(FLAG_VERDICTS)
    tag = verdicts.release_tag()
    commit, _ = verdicts.inventory(tag)
    with warnings.catch_warnings():  # a cold cache imports megatron-core, which warns on CPU
        warnings.simplefilter("ignore")
        applied = frozenset(importlib.import_module(FLAG_TABLE).flag_table()[0])
    rows = []
    for dest, spec in verdicts.lm_dests(tag).items():
        rows.append((spec.group, spec.flags, dest, verdicts.classify(dest, applied, tag)))
    return tag, commit, rows


def flags_markdown() -> str:
    tag, commit, rows = megatron_flag_rows()
    counts = Counter(verdict.kind for *_, verdict in rows)
    out = [
        f"Inventory `{tag}` (Megatron-LM commit `{commit}`), the one the installed megatron-core "
        f"picks: {len(rows)} arguments; "
        + ", ".join(
            f"{counts[k]} {k}"
            for k in ("applied", "aliased", "ignored", "refused", "unknown")
            if counts[k]
        )
        + ".",
        "",
    ]
    by_group: dict[str, list] = defaultdict(list)
    for row in rows:
        by_group[row[0]].append(row)
    for group in sorted(by_group):
        out += [
            f"### {group}",
            "",
            "| flag | verdict | reason | what to do |",
            "| --- | --- | --- | --- |",
        ]
        for _, flags, _dest, verdict in sorted(by_group[group], key=lambda r: r[1]):
            out.append(
                f"| {', '.join(_code(f) for f in flags)} | {verdict.kind} | "
                f"{_cell(verdict.reason)} | {_cell(verdict.hint or '')} |"
            )
        out.append("")
    return "\n".join(out)


def _fill(app, docname: str, source: list[str]) -> None:
    if RECIPE_MARKER in source[0]:
        source[0] = source[0].replace(RECIPE_MARKER, recipe_markdown())
    if FLAGS_MARKER in source[0]:
        source[0] = source[0].replace(FLAGS_MARKER, flags_markdown())


def _always_outdated(app, env, added, changed, removed) -> list[str]:
    """The generated pages follow the code, not their own files: read them on every build."""
    return [name for name in GENERATED if name in env.found_docs]


def setup(app):
    app.connect("source-read", _fill)
    app.connect("env-get-outdated", _always_outdated)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
