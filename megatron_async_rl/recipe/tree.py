"""The recipe as a tree: YAML file -> tree, `--set` overrides, tree -> dataclasses, and back.

Owned here: `load_recipe` (a YAML file, a key given twice refused), `apply_overrides` (`--set
a.b.c=value`, each path checked against the schema), `build_dataclass` (a schema dataclass from
its YAML mapping, unknown and missing keys refused), `to_tree` and `write_resolved` (the resolved
config written as a recipe that reads back equal, `RESOLVED_NAME`). `recipe.load` calls them
while it resolves a run; every mistake raises `ConfigError` naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_async_rl.config.errors import (
    NO_VALUE,
    ConfigError,
    suggest,
    yaml_error_to_config_error,
)
from megatron_async_rl.config.megatron import table
from megatron_async_rl.recipe.schema import (
    ROLES,
    ResolvedConfig,
    RoleGroupSpec,
    RolesConfig,
    RunConfig,
)

RESOLVED_NAME = "config.resolved.yaml"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if isinstance(key, typing.Hashable):
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_recipe(path: str | Path) -> dict:
    """Read a recipe file into a plain tree (dicts, lists, scalars)."""
    recipe = Path(path)
    if not recipe.is_file():
        rule = "is a directory, not a recipe file" if recipe.is_dir() else "recipe file not found"
        raise ConfigError("--config", str(path), rule, f"relative paths start at {Path.cwd()}")
    try:
        tree = yaml.load(recipe.read_text(), Loader=_StrictLoader)
    except yaml.YAMLError as err:
        raise yaml_error_to_config_error(err, str(path)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("--config", str(path), f"cannot read the file: {err}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError("--config", str(path), "a recipe must be a YAML mapping at the top")
    return tree


_SET_HINT = "write --set a.b.c=value, e.g. --set roles.groups[0].num_ranks=2"
_PART = re.compile(r"^([A-Za-z_][\w-]*)((?:\[\d+\])*)$")


def _split_path(text: str, where: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in text.split("."):
        if piece.isdigit():
            parts.append(int(piece))
            continue
        match = _PART.match(piece)
        if match is None:
            raise ConfigError("--set", where, f"bad key path component {piece!r}", _SET_HINT)
        parts.append(match.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return parts


def _check_set_path(parts: list[str | int], where: str) -> None:
    """Reject a `--set` path that names no field of the recipe schema."""
    node: Any = RunConfig
    dotted = ""
    for part in parts:
        if node == "free":  # a megatron: mapping; its keys are checked by build_config
            return
        if node == "leaf":
            raise ConfigError("--set", where, f"{dotted} is a value, not a mapping", _SET_HINT)
        if isinstance(node, tuple):  # list of dataclasses: expects an index
            if not isinstance(part, int):
                raise ConfigError("--set", where, f"{dotted} is a list: index it", _SET_HINT)
            node, dotted = node[1], f"{dotted}[{part}]"
            continue
        children = _children(node)
        if part not in children:
            prefix = f"{dotted}." if dotted else ""
            hint = suggest(str(part), list(children), prefix)
            raise ConfigError("--set", where, f"unknown key {prefix}{part}", hint)
        node, dotted = children[part], f"{dotted}.{part}" if dotted else str(part)


def _children(node: Any) -> dict[str, Any]:
    """The YAML-shaped schema under `node`: name -> dataclass, (list, cls), 'free' or 'leaf'."""
    if node == "role":
        return {"megatron": "free"}
    if node is RolesConfig:
        return {"groups": ("list", RoleGroupSpec), **{role: "role" for role in ROLES}}
    hints = typing.get_type_hints(node)
    out = {}
    for field in dataclasses.fields(node):
        kind = hints[field.name]
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(options) == 1 and dataclasses.is_dataclass(options[0]):
            kind = options[0]  # an optional section: `data: DatasetConfig | None`
        if dataclasses.is_dataclass(kind):
            out[field.name] = kind
        elif typing.get_origin(kind) is dict:
            out[field.name] = "free"
        else:
            out[field.name] = "leaf"
    return out


def apply_overrides(tree: dict, sets: list[str]) -> None:
    """Apply `--set a.b.c=value` overrides to a recipe tree in place (value parsed as YAML)."""
    for text in sets:
        path_text, has_eq, value_text = text.partition("=")
        if not has_eq or not path_text.strip():
            raise ConfigError("--set", text, "expected KEY.PATH=VALUE", _SET_HINT)
        parts = _split_path(path_text.strip(), text)
        _check_set_path(parts, text)
        try:
            value = yaml.safe_load(value_text)
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or "malformed YAML"
            raise ConfigError("--set", text, f"value is not valid YAML: {problem}") from None
        node: Any = tree
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    size = len(node) if isinstance(node, list) else 0
                    raise ConfigError("--set", text, f"index {part} is out of range ({size} items)")
            elif not isinstance(node, dict):
                raise ConfigError("--set", text, f"cannot set {part!r} inside {node!r}")
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]


def _join(key: str, name: Any) -> str:
    return f"{key}.{name}" if key else str(name)


def _reject_unknown(data: dict, names: list[str], key: str) -> None:
    for name, value in data.items():
        if name not in names:
            hint = suggest(str(name), names, f"{key}." if key else "")
            raise ConfigError(_join(key, name), value, "unknown key", hint)


def build_dataclass(cls: type, data: Any, key: str) -> Any:
    """Build dataclass `cls` from a YAML mapping, rejecting unknown and missing keys (`key`: the
    recipe path of `data`, "" at the top)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(key, data, "must be a mapping")
    children = _children(cls)
    _reject_unknown(data, list(children), key)
    kwargs: dict[str, Any] = {}
    if cls is RolesConfig:
        groups = data.get("groups", NO_VALUE)
        if groups is NO_VALUE:
            raise ConfigError(_join(key, "groups"), NO_VALUE, "missing required key")
        if not isinstance(groups, list):
            raise ConfigError(_join(key, "groups"), groups, "must be a list of role groups")
        kwargs["groups"] = [
            build_dataclass(RoleGroupSpec, item, f"{key}.groups[{i}]")
            for i, item in enumerate(groups)
        ]
        kwargs["megatron"] = {}
        for role in ROLES:
            if data.get(role) is not None:
                section = data[role]
                if not isinstance(section, dict):
                    raise ConfigError(_join(key, role), section, "must be a mapping")
                _reject_unknown(section, ["megatron"], _join(key, role))
                kwargs["megatron"][role] = section.get("megatron") or {}
    else:
        for field in dataclasses.fields(cls):
            value = data.get(field.name, NO_VALUE)
            if value is NO_VALUE:
                required = field.default is dataclasses.MISSING
                if required and field.default_factory is dataclasses.MISSING:
                    raise ConfigError(_join(key, field.name), NO_VALUE, "missing required key")
                continue
            kind = children[field.name]
            if value is None and field.default is None:  # an optional section left out
                kwargs[field.name] = None
                continue
            if dataclasses.is_dataclass(kind):
                value = build_dataclass(kind, value, _join(key, field.name))
            kwargs[field.name] = value
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.with_prefix(key) from None


def to_tree(cfg: RunConfig) -> dict:
    """The recipe tree of a config (what `load_recipe` would return for it)."""
    roles: dict[str, Any] = {
        "groups": [
            {k: v for k, v in dataclasses.asdict(g).items() if v is not None}
            for g in cfg.roles.groups
        ]
    }
    roles.update({role: {"megatron": dict(s)} for role, s in cfg.roles.megatron.items() if s})
    tree: dict[str, Any] = {}
    for field in dataclasses.fields(RunConfig):
        value = getattr(cfg, field.name)
        if field.name == "roles":
            tree["roles"] = roles
        elif dataclasses.is_dataclass(value):
            tree[field.name] = dataclasses.asdict(value)
        elif isinstance(value, dict):
            tree[field.name] = dict(value)
        elif value is not None:
            tree[field.name] = value
    return tree


def write_resolved(cfg: ResolvedConfig, path: str | Path) -> Path:
    """Write `cfg` as a recipe that `load_recipe` + `build_config(tree, [])` reads back equal."""
    path = Path(path)
    defaults = table.defaults()
    lines = [
        "# Resolved config: recipe + --set + Megatron flags (folded into roles.<role>.megatron).",
        "# Run it again with --config <this file>. Effective Megatron args that differ from",
        "# their defaults, per role:",
    ]
    for role, args in cfg.role_megatron_args.items():
        changed = ", ".join(f"{k}={v}" for k, v in sorted(args.items()) if defaults.get(k) != v)
        lines += textwrap.wrap(
            f"{role}: {changed or '(all defaults)'}",
            96,
            initial_indent="#   ",
            subsequent_indent="#     ",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + yaml.safe_dump(to_tree(cfg), sort_keys=False))
    return path
