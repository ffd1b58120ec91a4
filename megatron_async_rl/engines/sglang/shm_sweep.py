"""Shared-memory segments that killed SGLang engines left in /dev/shm, removed at the next start;
the load-snapshot file of an engine killed before it served.

Owned here: `remove_stale_segments`, `load_snapshot_files`, `remove_files`. Called by
`engines/sglang/engine.py`: the sweep before an engine starts, the other two when an engine
or a launch nobody adopted ends.

SGLang names its message-queue segments `sgl_shm_<kind>_<pid>_<random>` after the process
that made them and unlinks them only on a clean exit; an engine killed with its rank (SIGKILL,
a restart under `--max-restarts`) leaves them, 24 MiB each on CPU, until /dev/shm is full. A
segment whose creator is no longer alive is removed; nothing of a live process is touched, so
engines of other runs on the node are safe. (SGLang's own sweep,
`sglang.srt.utils.stale_shm_cleanup`, also removes whole families unconditionally and only in
its CI; its pid rule is the one followed here.)
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PREFIX = "sgl_shm_"
LOAD_SNAPSHOT_PREFIX = "sglang_loads_"
"""SGLang's load-snapshot slot files, `sglang_loads_<instance id>_<digest>.shm`: no pid in the
name, and SGLang never removes them."""


def _creator(name: str) -> int | None:
    parts = name.split("_")  # sgl, shm, <kind...>, <pid>, <random>
    if not name.startswith(PREFIX) or len(parts) < 5 or not parts[-2].isdigit():
        return None
    pid = int(parts[-2])
    return pid if pid > 0 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_segments(directory: str | Path = "/dev/shm") -> list[str]:
    """Unlink the SGLang segments in `directory` whose creating process is gone; their names."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in Path(directory).iterdir():
            pid = _creator(entry.name)
            if pid is not None and not _alive(pid):
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry.name)
    return removed


def load_snapshot_files(pid: int) -> list[str]:
    """The load-snapshot files that process `pid` and its descendants hold open. The scheduler
    makes its file early in its start, before the engine reports ready (and with it the file's
    name), so a launch killed before that report finds its file only here."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    found = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            found.update(f.path for f in proc.open_files()
                         if Path(f.path).name.startswith(LOAD_SNAPSHOT_PREFIX))  # fmt: skip
    return sorted(found)


def remove_files(paths) -> None:
    """Unlink `paths`, those already gone skipped."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
