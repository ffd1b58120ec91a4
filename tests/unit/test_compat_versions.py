"""Every compatibility patch is installed exactly on the releases that have its defect.

Contract (`compat/versions.py`): each patch in `compat/` (`megatron_cpu.PATCHES`,
`megatron_fixes.PATCHES`, `megatron_mtp.PATCHES`) declares the megatron-core releases that have
its defect; its probe, run against the unpatched upstream in a fresh interpreter, finds the
defect on the installed release if and only if the declared range holds that release. Run on both
ends of the supported range (scripts/test.sh runs this file in each environment), this shows the
defect where a patch applies and its absence where it does not. Also: `install` applies only the
patches in range, and a malformed range is refused. Nothing is faked but the patches of the last
two tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_async_rl.compat import versions

_PROBE_ALL = r"""
import json, warnings
warnings.simplefilter("ignore")
from megatron_async_rl.compat import megatron_cpu, megatron_fixes, megatron_mtp, versions
rows = []
for module in (megatron_cpu, megatron_fixes, megatron_mtp):
    for patch in getattr(module, "PATCHES", ()):
        version = versions.installed_version(patch.package)
        rows.append({"module": module.__name__, "name": patch.name, "version": version,
                     "versions": patch.versions, "defect": bool(patch.probe()),
                     "applies": patch.applies_to(version)})
print("ROWS" + json.dumps(rows))
"""


@pytest.fixture(scope="module")
def probes() -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE_ALL], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("ROWS"))
    return json.loads(line[4:])


def test_a_patch_applies_where_its_defect_is_and_nowhere_else(probes):
    assert len(probes) >= 15  # the CPU layer's, the fixes', the MTP module's
    names = [row["name"] for row in probes]
    assert len(names) == len(set(names)), names
    wrong = [row for row in probes if row["defect"] != row["applies"]]
    print("\n" + "\n".join(
        f"{r['module'].rsplit('.', 1)[1]:14} {r['name']:28} {r['versions']:16} "
        f"megatron-core {r['version']}: defect {'present' if r['defect'] else 'absent '}, "
        f"{'patched' if r['applies'] else 'not patched'}"
        for r in probes
    ))  # fmt: skip
    assert not wrong, (
        "declared ranges disagree with the upstream defects on this release (narrow the range "
        f"where upstream fixed it, widen it where the defect is still there): {wrong}"
    )


def test_install_applies_only_the_patches_in_range(monkeypatch):
    applied = []
    monkeypatch.setattr(versions, "installed_version", lambda package: "0.19.2")

    def patch(name, spec):
        return versions.Patch(name, "megatron-core", spec, "a defect",
                              lambda: applied.append(name), lambda: True)  # fmt: skip

    names = versions.install([patch("old", ">=0.16.1,<0.17"), patch("both", ">=0.16.1,<0.20"),
                              patch("new", "==0.19.*")])  # fmt: skip
    assert names == applied == ["both", "new"]


def test_a_malformed_range_is_refused():
    with pytest.raises(Exception, match="0.16.1-0.19"):
        versions.Patch("bad", "megatron-core", "0.16.1-0.19", "d", lambda: None, lambda: True)
