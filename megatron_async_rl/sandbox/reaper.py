"""The parent of one bubblewrap run: `python -I -S .../sandbox/reaper.py LIMITS-JSON
BWRAP-ARGV...` (LIMITS-JSON: a `SandboxConfig`'s fields).

It makes itself the child subreaper of its subtree, starts bubblewrap under the limits
(`apply_limits`: rlimits, and the user nobody when run as root), and once it has ended waits
for every process left under it, so that the sandbox's processes (killed with its PID namespace)
are reaped here, not left as zombies where the host's init does not reap (a container without
one). SIGTERM (the caller's wall or output limit) kills bubblewrap at once. Exits with
bubblewrap's status (128 + N for a signal N).

Run by its path with only the standard library (no package import, no site): its start-up is
part of every tool call (`run.run_sandboxed`); `python -I -m` of the package cost ~0.15 s of CPU
a call in imports alone.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36
NOBODY = 65534
BWRAP_PROCESSES = 3
"""Ours: this reaper, bubblewrap's monitor, and the program's first process."""


def apply_limits(limits: dict) -> None:
    """In bubblewrap's process, before it starts: the rlimits of `limits` (a `SandboxConfig`'s
    fields), then (as root) the user nobody. Processes are counted by RLIMIT_NPROC per user: as
    nobody, the sandboxes' own; as another user, its current count plus `max_processes`."""
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = limits["max_file_mb"] << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        tasks = 0
    else:
        tasks = _tasks_of(os.getuid())
    nproc = tasks + limits["max_processes"] + BWRAP_PROCESSES
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _tasks_of(uid: int) -> int:
    """Processes and threads of `uid` now (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return count


def main(argv: list[str]) -> int:
    limits = json.loads(argv[0])
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = os.fork()
    if child == 0:
        try:
            apply_limits(limits)
            os.execv(argv[1], argv[1:])
        except BaseException as err:  # noqa: BLE001 - the child must never return
            os.write(2, f"sandbox: cannot start bubblewrap: {err}\n".encode())
        os._exit(127)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    status = None
    while True:  # bubblewrap, then everything left under this process (killed with it)
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            status = os.waitstatus_to_exitcode(raw)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
