"""`engines.sglang.shm_sweep`: segments of dead SGLang processes go, those of live ones stay."""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_async_rl.engines.sglang.shm_sweep import remove_stale_segments


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(proc.stdout)


def test_only_segments_of_dead_creators_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    names = {
        f"sgl_shm_mq_{dead}_c6500af2": False,  # SGLang's message queue, creator gone
        f"sgl_shm_mm_feature_{dead}_1aae7f4d": False,
        f"sgl_shm_mq_{alive}_5ec96615": True,  # a live engine's: kept
        f"sglang_loads_{dead}": True,  # not pid-stamped by SGLang's rule: not ours to judge
        "sem.mp-2kqyjx1r": True,
        "sgl_shm_mq_notapid_x": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_segments(tmp_path)
    assert sorted(removed) == sorted(n for n, kept in names.items() if not kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, k in names.items() if k)


def test_a_missing_directory_is_nothing_to_do(tmp_path):
    assert remove_stale_segments(tmp_path / "absent") == []
