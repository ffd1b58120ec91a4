"""Reading Megatron flags and `megatron:` sections through Megatron-LM's verdicts.

Owned here: `parse_megatron_flags` (the flags after `--`, read with Megatron-LM's own arity),
`normalize_megatron_section` (a recipe's `megatron:` mappings), and who prints what they note
(`reports_config_notes`). Each dest given follows its verdict in `inventory.classify`:
applied values are typed by `table` (the table of what we build from), aliases are
translated, ignored flags go to one warning line, refused and unknown ones are collected and
raised together. Callers: `recipe.load` and `recipe.schema`.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_async_rl.config.checks import require_bool
from megatron_async_rl.config.errors import NO_VALUE, ConfigError, raise_all, suggest, warn_once
from megatron_async_rl.config.megatron import inventory
from megatron_async_rl.config.megatron.table import RENAMED, coerce, flag_table
from megatron_async_rl.config.megatron.verdicts import (
    ALIASES,
    RECIPE_ALIAS_VALUES,
    RECIPE_ALIASES,
    REFUSED_CHOICES,
    REFUSED_VALUES,
)


def _unknown(
    key: str, candidates: list[str], display: str, kind: str, value: Any = NO_VALUE
) -> ConfigError:
    stem = key.lstrip("-").replace("-", "_")
    if stem in RENAMED:
        renamed = RENAMED[stem]
        spelt = "--" + renamed.replace("_", "-") if kind == "flag" else renamed
        hint = f"Megatron-LM spells it {spelt}"
    else:
        hint = suggest(key, candidates)
    return ConfigError(display, value, f"unknown Megatron {kind}", hint)


class ParsedFlags(dict):
    """dest -> typed value, plus `recipe_sets`: recipe key -> (value, flag) for the flags whose
    owner is a recipe key (`verdicts.RECIPE_ALIASES`), applied by `recipe.load.build_config`."""

    def __init__(self):
        super().__init__()
        self.recipe_sets: dict[str, tuple[Any, str]] = {}


VALIDATED_ENV = "MEGATRON_ASYNC_RL_VALIDATED"
"""Set by the launchers once their dry run has checked the recipe (and said what it ignores)."""


def reports_config_notes() -> bool:
    """Who prints what resolving the config noted (ignored flags, overridden recipe keys): a
    process outside torchrun (the launchers' dry run, a direct dry run), or rank 0 when no
    launcher checked the recipe first; so each note is printed once per run."""
    if "RANK" not in os.environ:
        return True
    return os.environ["RANK"] == "0" and os.environ.get(VALIDATED_ENV) != "1"


class _Verdicts:
    """Applies Megatron-LM's verdict on each dest given; collects ignored flags and errors."""

    def __init__(self, last_wins: bool):
        self.last_wins = last_wins
        """argparse's rule on a command line (a flag given twice: the last counts); in a recipe
        section, two keys that set one dest are an error."""
        self.specs = flag_table()[0]
        self.applied = frozenset(self.specs)
        self.parsed = ParsedFlags()
        self.origin: dict[str, str] = {}
        self.ignored: dict[str, list[str]] = {}
        self.errors: list[ConfigError] = []

    def put(self, dest: str, value: Any, key: str) -> None:
        """Set `dest` from `value` (given as `key`), following the dest's verdict."""
        verdict = inventory.classify(dest, self.applied)
        try:
            if dest in RECIPE_ALIASES:
                path = RECIPE_ALIASES[dest]
                if not self.last_wins:
                    raise ConfigError(key, value, "is a recipe key here", f"set {path} instead")
                translate = RECIPE_ALIAS_VALUES.get(dest)
                if translate is not None:
                    value = translate(value)
                self.parsed.recipe_sets[path] = (value, key)
            elif dest in self.specs and (
                dest in REFUSED_VALUES or dest in REFUSED_CHOICES
            ):
                # a config field some of whose values ask for what is not built here
                value = coerce(self.specs[dest], value, key)
                refused = inventory.refused_value(dest, value)
                if refused is not None:
                    raise ConfigError(key, value, *refused)
                self._set(dest, value, key)
            elif verdict.kind == "applied":
                self._set(dest, coerce(self.specs[dest], value, key), key)
            elif verdict.kind == "aliased":
                for target, translated in ALIASES[dest][1](value).items():
                    self._set(target, coerce(self.specs[target], translated, key), key)
            elif verdict.kind == "ignored":
                self.ignored.setdefault(verdict.reason, []).append(key)
            elif verdict.kind == "refused":
                raise ConfigError(key, value, verdict.reason, verdict.hint)
            else:
                raise ConfigError(key, value, "unknown Megatron argument")
        except ConfigError as err:
            self.errors.append(err)

    def _set(self, dest: str, value: Any, key: str) -> None:
        if dest in self.origin and not self.last_wins:
            raise ConfigError(key, value, f"sets {dest} again (already set by {self.origin[dest]})")
        self.origin[dest], self.parsed[dest] = key, value

    def finish(self, where: str) -> dict[str, Any]:
        raise_all(self.errors)
        if self.ignored and reports_config_notes():
            listed = "; ".join(
                f"{', '.join(keys)}: {reason}" for reason, keys in self.ignored.items()
            )
            warn_once(f"{where}: ignored, as they mean nothing for this RL trainer: {listed}")
        return self.parsed


def _values(spec, name: str, argv: list[str], index: int, expected: str) -> tuple[Any, int]:
    """The value(s) of flag `name` at argv[index:] by its Megatron-LM arity; (value, next)."""
    if spec.kind in ("true", "false", "const", "bool_optional"):
        if spec.kind == "const":
            return spec.const, index
        if spec.kind == "bool_optional":
            return not name.startswith("--no-"), index
        return spec.kind == "true", index
    taken = []
    while index < len(argv) and not (argv[index].startswith("--") and len(argv[index]) > 2):
        taken.append(argv[index])
        index += 1
        if spec.nargs in (None, "?") or (isinstance(spec.nargs, int) and len(taken) == spec.nargs):
            break
    if not taken and spec.nargs not in ("*", "?"):
        raise ConfigError(name, NO_VALUE, f"missing value{expected}")
    if spec.nargs in ("+", "*") or isinstance(spec.nargs, int):
        return taken, index
    return (taken[0] if taken else spec.const), index


def parse_megatron_flags(argv: list[str]) -> ParsedFlags:
    """Parse the Megatron flags given after `--` into dest -> typed value.

    Every flag of Megatron-LM is known (`inventory.inventory()`) and read with its own arity;
    the verdict on its dest (applied, aliased, ignored, refused) decides what it does. Ignored
    flags are listed in one warning line; every error of the command line is raised together.
    """
    ours = flag_table()[1]
    lm_flags = inventory.inventory()[1]
    verdicts = _Verdicts(last_wins=True)
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if not token.startswith("--") or token == "--":
            verdicts.errors.append(ConfigError(
                "megatron flags", token, "expected a --flag", "Megatron flags look like --lr 1e-6"
            ))  # fmt: skip
            while index < len(argv) and not argv[index].startswith("--"):
                index += 1  # one error for a run of stray words
            continue
        name, has_inline, inline = token.partition("=")
        lm, flag = lm_flags.get(name), ours.get(name)
        try:
            if lm is not None and not (flag is not None and lm.dest not in verdicts.applied):
                spec = verdicts.specs.get(lm.dest)
                expected = f" (expected {spec.type})" if spec else ""
                value, index = (
                    (inline, index) if has_inline else _values(lm, name, argv, index, expected)
                )
                if has_inline and lm.kind != "value":
                    raise ConfigError(
                        name, inline, "this flag takes no value", f"write {name} alone"
                    )
                if isinstance(value, list) and lm.dest in verdicts.specs:
                    if not verdicts.specs[lm.dest].type.endswith("_list"):
                        if len(value) != 1:
                            raise ConfigError(name, " ".join(value), "takes one value here")
                        value = value[0]
                verdicts.put(lm.dest, value, name)
            elif flag is not None:
                if flag.const is not None:
                    if has_inline:
                        raise ConfigError(
                            name, inline, "this flag takes no value", f"write {name} alone"
                        )
                    verdicts.put(flag.dest, flag.const, name)
                    continue
                if has_inline:
                    value = inline
                elif index < len(argv) and not argv[index].startswith("--"):
                    value, index = argv[index], index + 1
                else:
                    spec = verdicts.specs[flag.dest]
                    raise ConfigError(name, NO_VALUE, f"missing value (expected {spec.type})")
                verdicts.put(flag.dest, value, name)
            else:
                raise _unknown(name, sorted(set(lm_flags) | set(ours)), name, "flag")
        except ConfigError as err:
            verdicts.errors.append(err)
            while index < len(argv) and not argv[index].startswith("--"):
                index += 1  # skip the bad flag's values: report the next flag on its own
    return verdicts.finish("Megatron flags")


def normalize_megatron_section(section: dict | None, key_prefix: str) -> dict[str, Any]:
    """Validate a recipe's `megatron:` mapping into dest -> typed value.

    Keys may use dashes or underscores and may be a dest (`add_bias_linear: false`), a Megatron
    flag name (`disable_bias_linear: true`) or a `no_` negative of a bool (`no_bf16: true`).
    Megatron-LM's other dests follow their verdict (aliased, ignored with a warning, refused).
    """
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise ConfigError(key_prefix, section, "must be a mapping of Megatron argument -> value")
    specs, flags = flag_table()
    lm_flags = inventory.inventory()[1]
    verdicts = _Verdicts(last_wins=False)
    for raw_key, value in section.items():
        key = f"{key_prefix}.{raw_key}"
        name = str(raw_key).lstrip("-").replace("-", "_")
        flag = flags.get("--" + name.replace("_", "-"))
        lm = lm_flags.get("--" + name.replace("_", "-"))
        try:
            if name in specs:
                verdicts.put(name, value, key)
            elif flag is not None and flag.const is not None:
                require_bool(key, value)
                verdicts.put(flag.dest, flag.const if value else not flag.const, key)
            elif name.startswith("no_") and getattr(specs.get(name[3:]), "type", None) == "bool":
                verdicts.put(name[3:], not require_bool(key, value), key)
            elif name in inventory.lm_dests():
                verdicts.put(name, value, key)
            elif lm is not None and lm.kind in ("true", "false"):
                require_bool(key, value)
                stored = (lm.kind == "true") == bool(value)
                verdicts.put(lm.dest, stored, key)
            else:
                names = list(specs) + [f.flag[2:].replace("-", "_") for f in flags.values()]
                raise _unknown(name, names + list(inventory.lm_dests()), key, "argument", value)
        except ConfigError as err:
            verdicts.errors.append(err)
    return verdicts.finish(key_prefix)
