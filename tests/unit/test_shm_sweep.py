"""`engines.sglang.shm_sweep`: segments of dead SGLang processes go, those of live ones stay."""

from __future__ import annotations

import os
import subprocess
import sys

from megatron_async_rl.engines.sglang.shm_sweep import (
    load_snapshot_files,
    remove_files,
    remove_stale_segments,
)


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


def test_the_load_snapshot_files_a_process_tree_holds_are_found_and_removed(tmp_path):
    """A child of a child holding `sglang_loads_*` open (as SGLang's scheduler under an engine
    host does) is found from the top pid; a file of another name is not."""
    held, other = tmp_path / "sglang_loads_0a1b2c3d4e5f_01234567.shm", tmp_path / "other.shm"
    script = (f"import subprocess, sys; subprocess.run([sys.executable, '-c', "
              f"\"a = open({str(held)!r}, 'w'); b = open({str(other)!r}, 'w'); "
              f"print('open', flush=True); import time; time.sleep(60)\"])")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        assert load_snapshot_files(proc.pid) == [str(held)]
    finally:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
    remove_files([held, tmp_path / "absent"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.shm"]
    assert load_snapshot_files(proc.pid) == []  # gone: nothing to find
