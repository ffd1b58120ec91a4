"""Every flag of Megatron-LM, and what each one does here: applied, aliased, ignored or refused.

Owned here: the inventories of Megatron-LM's flags, one per supported megatron-core release series
(`megatron_lm_flags/<tag>.json`, written by `scripts/megatron_lm_flag_inventory.py` from the
Megatron-LM tag in `RELEASES`; the installed megatron-core picks one: `release_tag`), and the
verdict on each flag's dest (`classify`, from the tables of `config.megatron.verdicts`):

- **applied**: the dest is a Megatron argument we build from (`table.flag_table()`: a
  megatron-core config field, a GPTModel argument, or a knob of our loop: LR schedule, batches
  and their ramp, seed, steps, timeouts, the options of the role groups);
- **aliased**: a Megatron-LM spelling of an applied dest (`ALIASES`, value translated);
- **ignored**: means nothing for an RL trainer (pretraining data, tokenizer types, logging
  destinations, ...): accepted, and listed with its reason in one warning line;
- **refused**: asks for something this trainer does not do (legacy spellings Megatron-LM itself
  rejects, Megatron-LM's own RL loop, Megatron FSDP, ...): an error with the reason and a fix.

The tables hold the dests of every supported release; a dest that one release lacks is
simply never looked up there. Callers: `parse.parse_megatron_flags` and
`normalize_megatron_section` (the verdicts), `table` (the type and default of the
Megatron-LM arguments applied here), `tests/unit/test_megatron_lm_flags.py` (the classification
of every flag of each inventory, and its coverage).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.megatron.verdicts import (
    ALIASES,
    IGNORED,
    IGNORED_GROUPS,
    INERT_HERE,
    NOT_BUILT,
    ONLY_WITH,
    RECIPE_ALIASES,
    REFUSED,
    REFUSED_CHOICES,
    REFUSED_GROUPS,
    REFUSED_VALUES,
)

INVENTORY_DIR = Path(__file__).with_name("megatron_lm_flags")

SUPPORTED_RELEASES = ">=0.16.1,<0.20"
"""The megatron-core releases this package runs on (setup.py's range)."""

RELEASES = {
    (0, 16): "core_v0.16.1",
    (0, 17): "core_v0.17.1",
    (0, 18): "core_v0.18.2",
    (0, 19): "core_v0.19.0",
}
"""megatron-core release series -> the Megatron-LM tag whose flags its inventory holds: the
newest tag of the series in Megatron-LM's repository. A series keeps its flags across patch
releases (the inventories of core_v0.16.0 and core_v0.16.1 are equal, as are core_v0.18.0's and
core_v0.18.2's; core_v0.17.0 is a release candidate, 0.17.1 the release). 0.19 has tag
core_v0.19.0 only (its package_info says 0.19.1); the megatron-core 0.19.2 wheel differs from it
in four source files, none of them a config dataclass or an argument."""


def release_tag(version: str | None = None) -> str:
    """The inventory's tag for megatron-core `version` (default: the installed release).

    ConfigError naming the release and the supported range when there is no inventory for it."""
    where = "installed megatron-core"
    if version is None:
        try:
            version = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(
                where, "not installed", "Megatron flags are read by the megatron-core release",
                f"pip install 'megatron-core{SUPPORTED_RELEASES}'",
            ) from None  # fmt: skip
    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = None
    series = parsed and parsed.release[:2]
    if parsed is None or not SpecifierSet(SUPPORTED_RELEASES).contains(parsed, prereleases=True) \
            or series not in RELEASES:  # fmt: skip
        tags = ", ".join(f"{a}.{b}.x: {tag}" for (a, b), tag in RELEASES.items())
        raise ConfigError(
            where, version, f"has no Megatron-LM flag inventory here: supported releases are "
            f"{SUPPORTED_RELEASES} ({tags})", f"pip install 'megatron-core{SUPPORTED_RELEASES}'",
        )  # fmt: skip
    return RELEASES[series]


@dataclass(frozen=True)
class LMFlag:
    """One argparse action of Megatron-LM: its option strings and how it reads its value."""

    flags: tuple[str, ...]
    dest: str
    kind: Literal["value", "true", "false", "const", "append", "bool_optional"]
    const: Any
    nargs: Any
    """None: one value; "+", "*", "?" or an int as argparse means them (kind value/append)."""
    type: str | None
    choices: tuple | None
    default: Any
    group: str


@functools.cache
def inventory(tag: str | None = None) -> tuple[str, dict[str, LMFlag]]:
    """(Megatron-LM commit, option string -> LMFlag) for every flag of Megatron-LM at `tag`
    (default: the tag of the installed megatron-core, `release_tag`)."""
    table = json.loads((INVENTORY_DIR / f"{tag or release_tag()}.json").read_text())
    flags: dict[str, LMFlag] = {}
    for row in table["flags"]:
        spec = LMFlag(
            tuple(row["flags"]), row["dest"], row["kind"], row["const"], row["nargs"],
            row["type"], tuple(row["choices"]) if row["choices"] else None, row["default"],
            row["group"],
        )  # fmt: skip
        for flag in spec.flags:
            flags[flag] = spec
    return table["commit"], flags


@functools.cache
def lm_dests(tag: str | None = None) -> dict[str, LMFlag]:
    """dest -> one of its actions, for every dest of Megatron-LM at `tag` (see `inventory`)."""
    return {spec.dest: spec for spec in inventory(tag)[1].values()}


def refused_value(dest: str, value: Any) -> tuple[str, str] | None:
    """(reason, hint) when `value` of `dest` asks for what is not built here, else None."""
    choices = REFUSED_CHOICES.get(dest, {})
    if isinstance(value, str) and value in choices:
        return choices[value]
    rule = REFUSED_VALUES.get(dest)
    if rule is None or not rule[0](value):
        return None
    return rule[1], rule[2]


@dataclass(frozen=True)
class Verdict:
    kind: Literal["applied", "aliased", "ignored", "refused", "unknown"]
    reason: str = ""
    hint: str | None = None


def classify(dest: str, applied: set[str] | frozenset[str], tag: str | None = None) -> Verdict:
    """What this trainer does with Megatron-LM's `dest` (`applied`: the dests we build from;
    `tag`: the inventory, default the installed megatron-core's)."""
    spec = lm_dests(tag).get(dest)
    if dest in NOT_BUILT:
        return Verdict("refused", *NOT_BUILT[dest])
    if dest in REFUSED_VALUES:
        return Verdict("refused", *REFUSED_VALUES[dest][1:])
    if dest in ONLY_WITH:
        parent = ONLY_WITH[dest]
        return Verdict("ignored", f"read only with --{parent.replace('_', '-')}, refused here")
    if dest in INERT_HERE:
        return Verdict("ignored", INERT_HERE[dest])
    if dest in applied:
        return Verdict("applied")
    if dest in ALIASES:
        return Verdict("aliased", ALIASES[dest][0])
    if dest in RECIPE_ALIASES:
        return Verdict("aliased", f"recipe key {RECIPE_ALIASES[dest]}")
    if dest in REFUSED:
        return Verdict("refused", *REFUSED[dest])
    if dest in IGNORED:
        return Verdict("ignored", IGNORED[dest])
    if spec is None:
        return Verdict("unknown")
    if spec.group in REFUSED_GROUPS:
        return Verdict("refused", *REFUSED_GROUPS[spec.group])
    if spec.group in IGNORED_GROUPS:
        return Verdict("ignored", IGNORED_GROUPS[spec.group])
    return Verdict("unknown")
