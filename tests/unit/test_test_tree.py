"""The test tree's own structure: shared helpers live in non-test modules, ports come from the OS.

Contracts, over every Python file under tests/ (parsed with `ast`, nothing imported):
- no module imports a test module (`test_*.py`): what tests share lives in `tests/harness/` or
  in a helper module beside them (`tests/unit/pipeline_fakes.py`,
  `tests/distributed/reshard_world.py`), so that collecting one test module never runs another's
  module body and a test module can be moved or deleted alone;
- no port number is written into a test: a keyword, dict key, subscript or variable named like
  a port given a number, a positional argument given to a parameter named like a port (of a
  function defined in the module or imported from tests/), a `host:port` string, or the port
  argument of `TCPStore`; ports come from `tests/harness/ports.py:free_port`.
  `test_launch_scripts.py` is exempt: its fake `torchrun` and `srun` only record the argv the
  launch scripts build, nothing listens.
Each failure names the file and line. The checks are also run on small sources here, so that a
check that finds nothing is seen to be able to find something.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
PORT_EXEMPT = {
    "tests/unit/test_launch_scripts.py": "fake launchers record argv; nothing binds a port",
    "tests/unit/test_test_tree.py": "this checker's own examples",
}
ENDPOINT = re.compile(r"(?:^|[\w\]}.-]):(\d{4,5})(?:$|[/\s\"'])")
"""A `host:port` in a string (an f-string's literal part included): `127.0.0.1:29500`,
`{addr}:29671`, `tcp://head:29400/`."""


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def test_module_imports(source: str, path: str) -> list[str]:
    """`path:line: ...` for each import of a test module (absolute or relative)."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        hits = [name for name in names if _is_test_module(name)]
        if hits:
            found.append(f"{path}:{node.lineno}: imports the test module {hits[0]!r}")
    return found


test_module_imports.__test__ = False  # a checker, not a test (pytest collects `test_*`)


def _number(node) -> int | None:
    """The port number a constant spells (an int, or a string of digits), else None."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node.value, str) and node.value.strip().isdigit():
            return int(node.value)
    return None


def _fixed(node) -> bool:
    """A number other than 0 (port 0: the OS picks), or a dict of them (`{"fp32": 29655}`, also
    indexed)."""
    if isinstance(node, ast.Subscript):
        return _fixed(node.value)
    if isinstance(node, ast.Dict):
        return any(_fixed(v) for v in node.values)
    number = _number(node)
    return number is not None and number != 0


def _portish(name: str | None) -> bool:
    return name is not None and "port" in name.lower()


def _signatures(tree: ast.Module) -> dict[str, list[str]]:
    """{function name: its positional parameter names} of the functions `tree` defines."""
    return {
        node.name: [a.arg for a in node.args.posonlyargs + node.args.args]
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _imported_signatures(tree: ast.Module) -> dict[str, list[str]]:
    """The signatures of the functions `tree` imports by name from a module under tests/."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
            path = REPO.joinpath(*node.module.split(".")).with_suffix(".py")
            if path.is_file():
                defined = _signatures(ast.parse(path.read_text(), str(path)))
                out.update({a.asname or a.name: defined[a.name] for a in node.names
                            if a.name in defined})  # fmt: skip
    return out


def fixed_ports(source: str, path: str) -> list[str]:
    """`path:line: ...` for each port number written into `source`."""
    found = []
    tree = ast.parse(source, path)
    signatures = {**_imported_signatures(tree), **_signatures(tree)}

    def report(node, what: str) -> None:
        found.append(f"{path}:{node.lineno}: a fixed port ({what}); use tests.harness.ports")

    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and _portish(node.arg) and _fixed(node.value):
            report(node.value, f"{node.arg}=")
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    if _portish(key.value) and _fixed(value):
                        report(value, f"{key.value!r}:")
        elif isinstance(node, ast.Assign) and _fixed(node.value):
            for target in node.targets:
                name = target.id if isinstance(target, ast.Name) else None
                if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
                    name = str(target.slice.value)
                if _portish(name):
                    report(node, f"{name} =")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = ENDPOINT.search(node.value)
            if match and int(match.group(1)) != 0:
                report(node, f"endpoint {node.value!r}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "TCPStore" and len(node.args) > 1 and _fixed(node.args[1]):
                report(node, "TCPStore(host, port)")
            for param, arg in zip(signatures.get(name, []), node.args):
                if _portish(param) and _fixed(arg):
                    report(arg, f"{name}(..., {param}=...)")
    return found


fixed_ports.__test__ = False


def _files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_imports_a_test_module():
    found = []
    for path in _files():
        rel = str(path.relative_to(REPO))
        found += test_module_imports(path.read_text(), rel)
    assert not found, "\n".join(found)


def test_no_test_writes_a_port_number():
    found = []
    for path in _files():
        rel = str(path.relative_to(REPO))
        if rel not in PORT_EXEMPT:
            found += fixed_ports(path.read_text(), rel)
    assert not found, "\n".join(found)


def test_the_tree_has_what_the_checks_read():
    files = {str(p.relative_to(REPO)) for p in _files()}
    assert "tests/harness/ports.py" in files and len(files) > 100
    assert set(PORT_EXEMPT) <= files


@pytest.mark.parametrize("source", [
    "from tests.distributed.test_hf_parity import _role_args\n",
    "from tests.distributed import test_routing_replay as replay\n",
    "import tests.unit.test_upcycle\n",
    "def f():\n    from .test_mtp import FACTOR\n",
])  # fmt: skip
def test_an_import_of_a_test_module_is_named_with_its_line(source):
    (found,) = test_module_imports(source, "tests/x/test_a.py")
    assert found.startswith(f"tests/x/test_a.py:{source.count(chr(10))}: imports the test module")


@pytest.mark.parametrize("source", [
    "from tests.harness.roles import role_args\n",
    "from tests.unit.pipeline_fakes import make_cfg\n",
    "import pytest\nfrom megatron_async_rl.models import tiny\n",
])  # fmt: skip
def test_helper_imports_pass(source):
    assert test_module_imports(source, "tests/x/test_a.py") == []


@pytest.mark.parametrize(("source", "line"), [
    ("env = dict(os.environ, MASTER_PORT='29651')\n", 1),
    ("launch(port=29500)\n", 1),
    ("env = {'MASTER_PORT': '29655'}\n", 1),
    ("x = 1\nport = {'fp32': 29655, 'bf16': 29656}['fp32']\n", 2),
    ("os.environ['MASTER_PORT'] = '29500'\n", 1),
    ("argv = ['--rdzv-endpoint', f'{addr}:29671']\n", 1),
    ("url = 'http://127.0.0.1:8000/ok'\n", 1),
    ("store = dist.TCPStore('127.0.0.1', 29500, 1, True)\n", 1),
    ("def start(task, run_dir, port, log):\n    pass\n\n\nstart(task, d, 29661, log)\n", 5),
])  # fmt: skip
def test_a_port_number_is_named_with_its_line(source, line):
    (found,) = fixed_ports(source, "tests/x/test_a.py")
    assert found.startswith(f"tests/x/test_a.py:{line}: a fixed port")


@pytest.mark.parametrize("source", [
    "env = dict(os.environ, MASTER_PORT=str(free_port()))\n",
    "store = dist.TCPStore('127.0.0.1', port, 1, True)\n",
    "url = f'http://127.0.0.1:{port}/ok'\n",
    "os.environ['MASTER_PORT'] = '0'\n",
    "timeout = 29500\nsizes = {'hidden_size': 64}\nwhen = '12:30'\n",
    "def start(task, run_dir, log):\n    pass\n\n\nstart(task, d, 29661)\n",
])  # fmt: skip
def test_ports_from_the_os_pass(source):
    assert fixed_ports(source, "tests/x/test_a.py") == []
