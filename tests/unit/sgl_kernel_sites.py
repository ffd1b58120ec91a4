"""Where SGLang's CUDA path calls `sgl_kernel`, read from the installed SGLang's source.

Used by `test_kernel_free.py`: every call on the paths the kernel-free engine runs must be in a
fused op's forward (replaced by `forward_native` under `kernel_free.ENGINE_ENV`) or have an
entry in `kernel_free.OPS` or `GATED`. Branches for other platforms (`if _is_xpu:`, a
`forward_hip`) are left out; what remains is what CUDA would run.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

_PLATFORMS = "xpu|hip|npu|musa|cpu|mps|aiter"
_OTHER_PLATFORM = re.compile(rf"^_?(is|use)_?({_PLATFORMS})", re.I)  # _is_xpu, is_hip()
_OTHER_PLATFORM_METHOD = re.compile(rf"(^|_)({_PLATFORMS})($|_)")  # forward_xpu, biased_topk_xpu


@dataclass(frozen=True)
class Site:
    file: str
    line: int
    name: str  # as the shim resolves it: "rmsnorm", "utils.is_arch_support_pdl"
    function: str  # enclosing function ("" at module level)
    fused_op_forward: bool  # in forward_* of a class with forward_native (a BaseFusedOp)


def _predicate(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _operands(test: ast.AST) -> tuple[list[ast.AST], bool]:
    if isinstance(test, ast.BoolOp):
        return test.values, isinstance(test.op, ast.And)
    return [test], True


def _other_platform(test: ast.AST) -> bool:
    """`if _is_xpu:`, `if is_hip() and x:`, `if is_musa() or is_xpu():`: CUDA never enters."""
    operands, conjunction = _operands(test)
    other = [bool(_OTHER_PLATFORM.match(_predicate(o) or "")) for o in operands]
    return any(other) if conjunction else all(other)


def _cuda_test(test: ast.AST) -> bool:
    """`if _is_cuda:`, `if _is_cuda or _is_musa:`: CUDA always enters, never the else."""
    operands, conjunction = _operands(test)
    cuda = ["cuda" in (_predicate(o) or "").lower() for o in operands]
    return all(cuda) if conjunction else any(cuda)


def sites(path: Path, rel: str) -> list[Site]:
    tree = ast.parse(path.read_text())
    found: list[Site] = []
    # scope (tuple of function names) -> {local name: sgl_kernel name or None (shadowed)}
    bindings: dict[tuple, dict[str, str | None]] = {}
    uses: list[tuple[str, int, tuple, bool]] = []
    classes_with_native: set[tuple] = set()

    def walk(node, scope, cls, cuda):
        if isinstance(node, ast.ClassDef):
            if any(isinstance(b, ast.FunctionDef) and b.name == "forward_native"
                   for b in node.body):  # fmt: skip
                classes_with_native.add(scope + (node.name,))
            cls = scope + (node.name,)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if _OTHER_PLATFORM_METHOD.search(node.name):
                return
            scope = scope + (node.name,)
        if isinstance(node, ast.ImportFrom) and cuda:
            is_kernel = (node.module or "").split(".")[0] == "sgl_kernel"
            sub = (node.module or "")[len("sgl_kernel") + 1 :] if is_kernel else ""
            for alias in node.names:
                name = (sub + "." if sub else "") + alias.name
                bindings.setdefault(scope, {})[alias.asname or alias.name] = (
                    name if is_kernel else None
                )
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and cuda:
            uses.append((node.id, node.lineno, scope, cls))
        for field, value in ast.iter_fields(node):
            for child in value if isinstance(value, list) else [value]:
                if not isinstance(child, ast.AST):
                    continue
                branch = cuda
                if isinstance(node, ast.If):
                    if field == "body" and _other_platform(node.test):
                        branch = False
                    if field == "orelse" and _cuda_test(node.test):
                        branch = False
                walk(child, scope, cls, branch)

    walk(tree, (), None, True)
    for local, line, scope, cls in uses:
        target = None
        for depth in range(len(scope), -1, -1):  # innermost binding wins
            if local in bindings.get(scope[:depth], {}):
                target = bindings[scope[:depth]][local]
                break
        if target is None:
            continue
        method = scope[-1] if scope else ""
        fused = cls in classes_with_native and method.startswith("forward_")
        found.append(Site(rel, line, target, ".".join(scope), fused))
    return found
