"""Write an inventory of Megatron-LM's command-line flags (`config/megatron/megatron_lm_flags/`).

Megatron-LM's `megatron/training/arguments.py` builds most of its groups from dataclasses at import
time (`ArgumentGroupFactory`), so its flags cannot be read from the source text: this script
imports that file from a Megatron-LM tree at one tag (its own `megatron/` tree, first on
`sys.path`, not the installed megatron-core), builds the parser with `add_megatron_arguments`,
and records every action: its flags, dest, kind, arity, value type, choices, default and
argument group. Nothing else of Megatron-LM is kept. There is one inventory per megatron-core
release series, from the tag `config.megatron.inventory.RELEASES` names; to add one, export the
tag and run this, e.g.

    git --git-dir=Megatron-LM/.git archive core_v0.19.0 | tar -x -C /tmp/mlm-0.19
    PYTHONPATH=/path/to/six python scripts/megatron_lm_flag_inventory.py \
        --megatron-lm /tmp/mlm-0.19 --tag core_v0.19.0 \
        --commit 5be9626709af2722333bf54797c954c09edeada3

The file is written to `megatron_async_rl/config/megatron/megatron_lm_flags/<tag>.json`
(or `--out`).
The tree imports `six`, which this project does not install: put it on PYTHONPATH (`pip install
--target DIR six`). The commit is recorded (`git rev-parse HEAD` of a checkout, or `--commit`
for an exported tree). Python 3.11 lacks `typing.override`, which those trees import; an
identity decorator stands in for it here only. Run with this project's environment: the
inventories of core_v0.16.1 to core_v0.19.0 were written with megatron-core 0.16.1's
environment (the tree's own `megatron/core` is what the parser reads).
"""

from __future__ import annotations

import argparse
import enum
import json
import subprocess
import sys
import typing
import warnings
from pathlib import Path

_OUT_DIR = (
    Path(__file__).parents[1] / "megatron_async_rl" / "config" / "megatron" / "megatron_lm_flags"
)

_KINDS = {
    "_StoreAction": "value",
    "_StoreTrueAction": "true",
    "_StoreFalseAction": "false",
    "_StoreConstAction": "const",
    "_AppendAction": "append",
    "BooleanOptionalAction": "bool_optional",
}


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _type_name(kind) -> str | None:
    if kind is None:
        return None
    if kind in (int, float, str):
        return kind.__name__
    return "other:" + getattr(kind, "__name__", type(kind).__name__)


def inventory(checkout: Path, tag: str, commit: str | None = None) -> dict:
    commit = commit or subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True,
        check=True,
    ).stdout.strip()  # fmt: skip
    if not hasattr(typing, "override"):
        typing.override = lambda fn: fn
    sys.path.insert(0, str(checkout))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments

        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    rows = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        kind = _KINDS.get(type(action).__name__)
        if kind is None:
            raise SystemExit(f"unsupported argparse action {type(action).__name__}: {action}")
        rows.append({
            "flags": list(action.option_strings),
            "dest": action.dest,
            "kind": kind,
            "const": _jsonable(action.const) if kind == "const" else None,
            "nargs": action.nargs,
            "type": _type_name(action.type),
            "choices": _jsonable(list(action.choices)) if action.choices else None,
            "default": _jsonable(action.default),
            "group": group_of.get(id(action), "options"),
        })  # fmt: skip
    return {
        "source": "NVIDIA/Megatron-LM megatron/training/arguments.py (add_megatron_arguments)",
        "tag": tag,
        "commit": commit,
        "flags": rows,
    }


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--megatron-lm", type=Path, required=True, help="a Megatron-LM tree")
    cli.add_argument("--tag", required=True, help="the tag the tree is, e.g. core_v0.19.0")
    cli.add_argument(
        "--out", type=Path, help="default: config/megatron/megatron_lm_flags/<tag>.json"
    )
    cli.add_argument("--commit", help="the tree's commit, when it is not a git checkout")
    args = cli.parse_args()
    table = inventory(args.megatron_lm, args.tag, args.commit)
    args.out = args.out or _OUT_DIR / f"{args.tag}.json"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = ",\n".join(json.dumps(row) for row in table["flags"])  # one flag per line: diffable
    head = json.dumps({k: v for k, v in table.items() if k != "flags"})[:-1]
    args.out.write_text(f'{head}, "flags": [\n{rows}\n]}}\n')
    print(
        f"{len(table['flags'])} actions of Megatron-LM {args.tag} ({table['commit'][:12]}) -> "
        f"{args.out}"
    )


if __name__ == "__main__":
    main()
