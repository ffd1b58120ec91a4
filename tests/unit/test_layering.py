"""The package's import graph flows one way, and its pure modules stay pure.

Contract, in two parts.

Purity (checked at run time): each case of `PURITY` is imported into a fresh interpreter and
must not load the modules it names: the pure layout, reshard planner, scheduler, advantage
math and config modules import neither `torch.distributed` collectives, megatron nor sglang
(the modules that need no torch at all are held to "no torch"), and loading a recipe loads
config modules only (no numpy, no reward registry, no dataset). One subprocess serves every
case: it forks a bare child per case, so each case sees only what its own imports load.
Separately, the AST of every `PURE` module (lazy imports inside functions included) must not
import `torch.distributed`, megatron or sglang, which also covers modules that load torch (and
with it the `torch.distributed` package) for tensors only.

Layers (checked on the source): every import inside the package, at module level, inside a
function or under `TYPE_CHECKING`, goes to a module of the same or a lower layer of `LAYERS`,
bottom first:

    config          config/errors (+ warn_once), config/checks, config/roles, config/plugins
                    (module:attribute names a recipe gives), config/role_checks (the optional
                    roles' checkpoints), config/megatron/ (the flag table and the megatron-core
                    kwargs built from it, Megatron-LM's flag inventory and its verdicts, the
                    parse of flags and megatron: sections, cross-field rules on a role's args),
                    algorithms/critic_config (the recipe's critic: section),
                    algorithms/minibatch (batch arithmetic the recipe checks),
                    algorithms/batch_ramp (its G per RL step from megatron-core's calculator,
                    imported lazily) and
                    every <package>/config.py: the recipe's sections, pure and validated
    layout          distributed/layout (pure rank arithmetic), distributed/collective_errors,
                    distributed/pg_options (the role groups' options, planned from flags)
    groups          distributed/groups, distributed/platform, compat (torch.distributed)
    processes       processes/ (child processes with a time bound; imports nothing of ours),
                    sandbox/ (model-written code run in bubblewrap under limits)
    models          models/, moe/ (routed experts as data, their replay in Megatron routers)
    engines         engines/
    weight_sync     weight_sync/
    rollout, rewards, algorithms
    tasks           tasks/ (the demo tasks and their warm starts: they use the datasets, turns
                    and reward registry below; only the registry names one, by string)
    observability   observability/ (writers, trace, plots, utilization math; nothing above)
    roles           roles/ (the work each role does: Megatron roles, generate, learn)
    scheduler       scheduler/ (stage machines, queues, staleness, the scheduler thread: it
                    drives the roles' stages, which know nothing of it)
    clock           observability/clock (turns the scheduler's machine spans into traces
                    and timing metrics, so it sits above the scheduler it observes)
    recipe          recipe/ (schema, tree, load): the aggregate of every config module (and,
                    lazily, the layout, `models.hf_config` and `models.upcycle`); above
                    everything they may import, below the jobs that read them
    jobs            jobs/
    entry           train, cli

That is the issue's config -> layout -> groups -> roles -> scheduler -> jobs, with each package
placed where its imports are legal. A package's `__init__` sits in the lowest layer of its
modules (importing `rollout.config` runs `rollout/__init__`, so that file must not pull
`rollout.dataset` up into the config layer). Modules of one layer may import each other, but
no two modules may import each other, at module level, in a function or under TYPE_CHECKING
(no import cycle, not even one a function-level import closes). A failure names the file and
line, both modules and both layers.

Size (checked on the source): no module of the package passes `MAX_LINES` lines; split a module
by concept before it does. Nothing is faked; no process group is made.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megatron_async_rl"
PACKAGE_DIR = REPO_ROOT / PACKAGE
NO_HEAVY = ("torch", "numpy", "megatron.", "sglang")
MAX_LINES = 600

# name: (modules imported together into a fresh interpreter, module prefixes that must not load)
PURITY: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "distributed.layout": ((f"{PACKAGE}.distributed.layout",), ("torch", "megatron.")),
    "weight_sync.plan, algorithms": (
        tuple(
            f"{PACKAGE}.{name}"
            for name in ("weight_sync.plan", "algorithms.grpo", "algorithms.losses",
                         "algorithms.advantages", "algorithms.corrections")
        ),
        ("megatron.", "sglang"),
    ),
    "weight_sync.config": ((f"{PACKAGE}.weight_sync.config",), ("torch",)),
    "scheduler": (
        tuple(
            f"{PACKAGE}.scheduler.{name}"
            for name in (
                "config",
                "staleness",
                "machine",
                "queues",
                "states",
                "scheduler",
                "watchdog",
            )  # fmt: skip
        ),
        ("torch",),
    ),
    "recipe.load": (
        (
            f"{PACKAGE}.recipe.load",
            f"{PACKAGE}.config.megatron.table",
            f"{PACKAGE}.config.megatron.core_kwargs",
            f"{PACKAGE}.config.megatron.rules",
            f"{PACKAGE}.config.megatron.inventory",
            f"{PACKAGE}.config.megatron.parse",
            f"{PACKAGE}.algorithms.minibatch",
        ),
        ("megatron.", "torch"),
    ),
    "config.checks": (
        tuple(f"{PACKAGE}.config.{name}" for name in ("errors", "checks", "roles")),
        NO_HEAVY,
    ),
    "section configs": (
        tuple(
            f"{PACKAGE}.{name}.config"
            for name in (
                "algorithms",
                "checkpoint",
                "engines",
                "moe",
                "rewards",
                "rollout",
                "scheduler",
                "weight_sync",
            )  # fmt: skip
        ),
        NO_HEAVY,
    ),
}

# Modules that must not import torch.distributed, megatron or sglang anywhere in their source.
PURE = (
    "config.errors", "config.checks", "config.roles", "algorithms.config", "engines.config",
    "rewards.config", "rollout.config", "scheduler.config", "weight_sync.config",
    "distributed.layout", "weight_sync.plan", "models.dims", "models.names", "models.shards",
    "algorithms.grpo", "weight_sync.delta", "weight_sync.delta_wire",
    "algorithms.losses", "scheduler.states", "scheduler.machine", "scheduler.queues",
    "scheduler.staleness", "scheduler.scheduler", "checkpoint.config", "checkpoint.store",
    "distributed.collective_errors", "scheduler.watchdog", "algorithms.minibatch",
    "config.megatron.inventory", "config.megatron.verdicts", "config.megatron.parse",
    "moe.config", "moe.routing", "processes.worker_pool", "processes.isolated",
    "algorithms.advantages", "algorithms.corrections", "rollout.refill",
    "algorithms.critic_config", "config.role_checks", "distributed.pg_options",
)  # fmt: skip
IMPURE = ("torch.distributed", "megatron", "sglang")

# Bottom first. Patterns are module names relative to the package, matching the module and its
# submodules; "*.config" matches every <package>.config. The longest matching pattern wins.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("config", ("config.errors", "config.checks", "config.roles", "config.megatron",
                "config.plugins", "config.role_checks", "algorithms.minibatch",
                "algorithms.batch_ramp", "algorithms.critic_config", "*.config")),
    ("layout", ("distributed.layout", "distributed.collective_errors", "distributed.pg_options")),
    ("groups", ("distributed.groups", "distributed.platform", "distributed.devices", "compat")),
    ("processes", ("processes", "sandbox")),
    ("models", ("models", "moe")),
    ("engines", ("engines",)),
    ("weight_sync", ("weight_sync",)),
    ("rollout, rewards, algorithms", ("rollout", "rewards", "algorithms")),
    ("tasks", ("tasks",)),
    ("observability", ("observability",)),
    ("roles", ("roles",)),
    ("scheduler", ("scheduler",)),
    ("clock", ("observability.clock",)),
    ("checkpoint", ("checkpoint",)),
    ("recipe", ("recipe",)),
    ("jobs", ("jobs",)),
    ("entry", ("train", "cli")),
)  # fmt: skip

# One interpreter for every purity case: a bare parent forks a child per case, the child imports
# the case's modules and sends back the names of every module loaded.
_PROBE = r"""
import json, os, sys
results = {}
for name, modules in json.loads(sys.argv[1]).items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            for module in modules:
                __import__(module)
            out = {"modules": sorted(sys.modules)}
        except BaseException as err:
            out = {"error": f"{type(err).__name__}: {err}"}
        with os.fdopen(write, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        results[name] = json.load(f)
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    """Case name -> every module a fresh interpreter holds after importing the case's modules."""
    cases = {name: modules for name, (modules, _) in PURITY.items()}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(cases)],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    results = json.loads(proc.stdout)
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not errors, errors
    return {name: r["modules"] for name, r in results.items()}


@pytest.mark.parametrize("case", list(PURITY))
def test_pure_modules_load_nothing_heavy(case, loaded):
    modules, forbidden = PURITY[case]
    bad = [m for m in loaded[case] if m.startswith(forbidden)]
    assert not bad, f"importing {', '.join(modules)} loads {bad[:10]}"


def test_loading_a_recipe_loads_config_modules_only(loaded):
    ours = [m for m in loaded["recipe.load"] if m.split(".")[0] == PACKAGE]
    above = [m for m in ours if _layer(m) not in (0, _LAYER_INDEX["recipe"])]
    assert not above, f"recipe.load loads modules above the config layer: {above}"
    assert "numpy" not in loaded["recipe.load"]


# --- the import graph --------------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """Every module of the package (the engine's shims, for CPU and for CUDA without
    sgl-kernel, are top-level modules of the engine processes, not ours)."""
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if "cpu_shims" in path.parts or "kernel_free_shims" in path.parts:
            continue
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()
_LAYER_INDEX = {name: index for index, (name, _) in enumerate(LAYERS)}


def _pattern_matches(pattern: str, module: str) -> bool:
    rel = module.removeprefix(PACKAGE + ".")
    if pattern == "*.config":
        parts = rel.split(".")
        return len(parts) >= 2 and parts[1] == "config"
    return rel == pattern or rel.startswith(pattern + ".")


def _layer(module: str) -> int:
    """The layer index of a module; a package sits in the lowest layer of its modules."""
    if MODULES.get(module, Path()).name == "__init__.py":
        members = [m for m in MODULES if m.startswith(module + ".")]
        return min((_layer(m) for m in members), default=0)
    best = None
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if _pattern_matches(pattern, module):
                if best is None or pattern.count(".") >= best[0]:
                    best = (pattern.count("."), index)
    if best is None:
        raise AssertionError(f"module {module} has no layer: add it to LAYERS in {__file__}")
    return best[1]


def _layer_name(module: str) -> str:
    return LAYERS[_layer(module)][0]


def _imports(source: str, module: str, is_package: bool, known=MODULES):
    """(line, imported module, at module level) for every import in `source`: module level,
    in functions and under TYPE_CHECKING; `from a import b` names a.b when that is a module."""
    tree = ast.parse(source)
    top = {id(node) for node in tree.body}
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here[: len(here) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                yield node.lineno, target if target in known else base, id(node) in top


@functools.cache
def _internal_imports() -> tuple[tuple[Path, int, str, str, bool], ...]:
    """(path, line, from module, to module, at module level) for imports inside the package."""
    return tuple(_walk())


def _walk():
    for module, path in MODULES.items():
        for line, target, top in _imports(path.read_text(), module, path.name == "__init__.py"):
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]  # `import a.b.C`-style names: their module
            if target in MODULES and target != module:
                yield path, line, module, target, top


def _upward(edges) -> list[str]:
    return [
        f"{path.relative_to(REPO_ROOT)}:{line}: {src} (layer {_layer_name(src)}) imports {dst} "
        f"(layer {_layer_name(dst)}, higher)"
        for path, line, src, dst, _ in edges
        if _layer(dst) > _layer(src)
    ]


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_upward_import():
    upward = _upward(_internal_imports())
    assert not upward, "upward imports (see LAYERS in tests/unit/test_layering.py):\n" + "\n".join(
        upward
    )


def test_no_import_cycle():
    """Every import counts: one inside a function or under TYPE_CHECKING closes a cycle too
    (the two modules still depend on each other; only the order of loading hides it)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for _, _, src, dst, _ in _internal_imports():
        graph[src].add(dst)
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for dst in sorted(graph[module]):
            visit(dst, path + [module])
        done.add(module)

    for module in MODULES:
        visit(module, [])


def test_no_module_passes_the_line_limit():
    long = {
        str(path.relative_to(REPO_ROOT)): count
        for path in MODULES.values()
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concept): {long}"


@pytest.mark.parametrize("module", PURE)
def test_pure_module_source_imports_no_collective_megatron_or_sglang(module):
    name = f"{PACKAGE}.{module}"
    bad = [
        f"{MODULES[name].relative_to(REPO_ROOT)}:{line}: imports {target}"
        for line, target, _ in _imports(MODULES[name].read_text(), name, False)
        if any(target == name or target.startswith(name + ".") for name in IMPURE)
    ]
    assert not bad, bad


def test_the_walk_sees_lazy_type_checking_and_relative_imports_and_names_upward_ones():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import megatron_async_rl.config.errors\n"
        "from megatron_async_rl.distributed import layout\n"
        "if TYPE_CHECKING:\n"
        "    from megatron_async_rl.jobs import grpo_sync\n"
        "def f():\n"
        "    from ..scheduler.states import Stage\n"
        "    import torch.distributed as dist\n"
    )
    module = f"{PACKAGE}.weight_sync.plan"
    found = sorted(_imports(source, module, False))
    assert found == [
        (1, "typing", True),
        (2, f"{PACKAGE}.config.errors", True),
        (3, f"{PACKAGE}.distributed.layout", True),
        (5, f"{PACKAGE}.jobs.grpo_sync", False),
        (7, f"{PACKAGE}.scheduler.states", False),
        (8, "torch.distributed", False),
    ]
    path = MODULES[module]
    edges = [(path, line, module, dst, top) for line, dst, top in found if dst in MODULES]
    assert _upward(edges) == [
        f"{PACKAGE}/weight_sync/plan.py:5: {module} (layer weight_sync) imports "
        f"{PACKAGE}.jobs.grpo_sync (layer jobs, higher)",
        f"{PACKAGE}/weight_sync/plan.py:7: {module} (layer weight_sync) imports "
        f"{PACKAGE}.scheduler.states (layer scheduler, higher)",
    ]
