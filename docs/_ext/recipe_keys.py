"""Every key of a recipe, read from the config dataclasses: path, type, default, allowed values
and description.

The walk starts at the recipe's top dataclass (`RunConfig`) and descends into every field typed
by another dataclass (`platform.device`), a list of one (`roles.groups[].num_ranks`) or an
optional one (`data.path`). Descriptions are the attribute docstrings under each field, read
with `ast` from the class's source; a section field without one takes its dataclass's
docstring. Allowed values come from the `require_choice(..., self.<field>, CHOICES)` calls in
`__post_init__`. Only the pure config modules are imported (no torch, no megatron-core).

Used by `recipe_reference.py` (the Sphinx pages) and `tests/unit/test_docs.py`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass

SCHEMA_MODULE = "megatron_async_rl.recipe.schema"
"""The module that defines the recipe's top dataclass, `RunConfig`."""


def schema_module() -> types.ModuleType:
    return importlib.import_module(SCHEMA_MODULE)


def run_config_class() -> type:
    return schema_module().RunConfig


@dataclass(frozen=True)
class Key:
    path: str
    """Dotted path as a recipe or `--set` spells it (`scheduler.generate_ahead_steps`)."""
    type: str
    default: str
    choices: tuple[str, ...] | None
    description: str
    section: bool
    """True for a field typed by a dataclass (its keys follow)."""


def _class_ast(cls: type) -> ast.ClassDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, ast.ClassDef) else None


def _field_docs(cls: type) -> tuple[dict[str, str], dict[str, str]]:
    """(field -> attribute docstring, field -> annotation source) over the class and its bases."""
    docs: dict[str, str] = {}
    annotations: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        node = _class_ast(klass) if dataclasses.is_dataclass(klass) else None
        if node is None:
            continue
        body = node.body
        for index, stmt in enumerate(body):
            if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                continue
            name = stmt.target.id
            annotations[name] = ast.unparse(stmt.annotation)
            docs.pop(name, None)
            after = body[index + 1] if index + 1 < len(body) else None
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[name] = inspect.cleandoc(after.value.value)
    return docs, annotations


def _choices(cls: type) -> dict[str, tuple[str, ...]]:
    """field -> the choices `require_choice(key, self.<field>, CHOICES)` checks it against."""
    out: dict[str, tuple[str, ...]] = {}
    module = inspect.getmodule(cls)
    for klass in reversed(cls.__mro__):
        node = _class_ast(klass) if dataclasses.is_dataclass(klass) else None
        if node is None:
            continue
        for call in ast.walk(node):
            if not (
                isinstance(call, ast.Call)
                and getattr(call.func, "id", getattr(call.func, "attr", None)) == "require_choice"
                and len(call.args) >= 3
                and isinstance(call.args[1], ast.Attribute)
                and isinstance(call.args[1].value, ast.Name)
                and call.args[1].value.id == "self"
            ):
                continue
            spec = call.args[2]
            try:
                values = ast.literal_eval(spec)
            except ValueError:
                values = eval(  # noqa: S307 - a module constant's name, from our own source
                    compile(ast.Expression(spec), "<choices>", "eval"),
                    vars(inspect.getmodule(klass) or module),
                )
            out[call.args[1].attr] = tuple(str(v) for v in values)
    return out


def _dataclass_in(hint: typing.Any) -> tuple[type | None, bool]:
    """(the dataclass a field's type holds, whether it is a list of them)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint, False
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is list and args:
        inner, _ = _dataclass_in(args[0])
        return inner, inner is not None
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            inner, listed = _dataclass_in(arg)
            if inner is not None:
                return inner, listed
    return None, False


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def walk(cls: type | None = None, prefix: str = "") -> list[Key]:
    """Every key under `cls` (default: the recipe's top dataclass), depth first, in field order."""
    cls = cls or run_config_class()
    docs, annotations = _field_docs(cls)
    choices = _choices(cls)
    hints = typing.get_type_hints(cls, vars(inspect.getmodule(cls)))
    keys: list[Key] = []
    for field in dataclasses.fields(cls):
        if not field.init or field.name.startswith("_"):
            continue
        path = prefix + field.name
        inner, listed = _dataclass_in(hints.get(field.name))
        description = docs.get(field.name, "")
        if not description and inner is not None:
            description = inspect.cleandoc(inner.__doc__ or "")
            if description.startswith(f"{inner.__name__}("):  # dataclass's generated doc
                description = ""
        keys.append(
            Key(
                path=path,
                type=annotations.get(field.name, str(hints.get(field.name, ""))),
                default=_default(field),
                choices=choices.get(field.name),
                description=description,
                section=inner is not None,
            )
        )
        if inner is not None:
            keys.extend(walk(inner, f"{path}[]." if listed else f"{path}."))
    return keys
