"""Which releases of a dependency a compatibility patch applies to.

Owned here: the `Patch` record every patch in `compat/` is declared with, and `install`, which
applies exactly the patches whose version range holds the installed release. Called by
`megatron_fixes.install`, `megatron_cpu.install` and `megatron_mtp.install`; read by
`tests/unit/test_compat_versions.py`, which runs every patch's `probe` against the unpatched
upstream in a fresh process and checks that a patch is declared for a release if and only if
its defect is there (so a patch disappears when upstream fixes the defect, and a new release
that still has it is caught by the same test run on that release).

A patch names: the package and the PEP 440 range of the releases that have the defect
(`versions`), the defect in one line, `apply` (idempotent) and `probe`, which looks at the
unpatched upstream and returns whether the defect is there. Most probes read a signature or
the source of the function at fault (what the defect is: a call without a group, a missing
argument); the distributed tests show the failure each one causes.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
from collections.abc import Callable, Sequence

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One compatibility patch of a dependency's internals."""

    name: str
    """Short identifier, unique across `compat/` (tests and logs name the patch by it)."""
    package: str
    """The distribution patched: "megatron-core" or "sglang"."""
    versions: str
    """PEP 440 specifier set of the releases that have the defect, e.g. ">=0.16.1,<0.17"."""
    defect: str
    """What upstream does wrong, in one line."""
    apply: Callable[[], None]
    """Installs the patch (idempotent)."""
    probe: Callable[[], bool]
    """Whether the unpatched upstream in this process has the defect."""

    def __post_init__(self) -> None:
        SpecifierSet(self.versions)  # raises InvalidSpecifier naming the text

    def applies_to(self, version: str) -> bool:
        """Whether release `version` of `package` gets this patch."""
        return SpecifierSet(self.versions).contains(Version(version), prereleases=True)


@functools.cache
def installed_version(package: str) -> str:
    """The installed release of `package` (its distribution metadata)."""
    return importlib.metadata.version(package)


def install(patches: Sequence[Patch]) -> list[str]:
    """Apply the patches whose range holds the installed release; returns their names."""
    applied = []
    for patch in patches:
        if patch.applies_to(installed_version(patch.package)):
            patch.apply()
            applied.append(patch.name)
    return applied
