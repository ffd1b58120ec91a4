"""Run a program in the sandbox (`command.bwrap_argv`) under resource limits; never raises for
what the program does: every outcome is a `SandboxResult`.

The program's parent is a small reaper (`sandbox.reaper`), so that nothing is left as a zombie.
Limits: CPU seconds, address space, open files and file size are rlimits set before bubblewrap
starts (inherited by everything inside); processes by RLIMIT_NPROC, counted
per user: a run as root drops to `nobody` first (then the count is the sandboxes' own), a run
as another user allows its current task count plus `max_processes`; wall time and output size
are watched here, and at either limit the whole sandbox is killed (its session, and with it
its PID namespace).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_async_rl.sandbox.command import ENV, bwrap_argv, find_bwrap, program_for
from megatron_async_rl.sandbox.config import SandboxConfig

NOBODY = 65534
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
"""Where `python -I -m megatron_async_rl.sandbox.reaper` finds the package (isolated mode
ignores PYTHONPATH; the working directory is on sys.path with -m)."""
BWRAP_PROCESSES = 3
"""Ours: the reaper (`sandbox.reaper`), bubblewrap's monitor, and the program's first process."""


@dataclasses.dataclass
class SandboxResult:
    exit_code: int | None
    """The program's exit status (negative: killed by that signal); None when it did not run."""
    stdout: str
    stderr: str
    limit: str | None = None
    """The limit that stopped it: "wall", "cpu", "output" (None: none did)."""
    wall_s: float = 0.0
    error: str | None = None
    """Why it could not run at all (no bwrap, a bad language)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.limit is None and self.exit_code == 0


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing, or cannot make its namespaces on this machine."""


def run_code(language: str, code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """`code` in `language` ("python", "bash") in a fresh sandbox."""
    try:
        program = program_for(language, code)
    except ValueError as err:
        return SandboxResult(None, "", "", error=str(err))
    return run_sandboxed(program, config)


def run_sandboxed(program: list[str], config: SandboxConfig | None = None) -> SandboxResult:
    config = config or SandboxConfig()
    bwrap = find_bwrap()
    if bwrap is None:
        return SandboxResult(None, "", "", error="bubblewrap (bwrap) is not installed")
    start, cpu_before = time.monotonic(), _children_cpu_s()
    reaper = [sys.executable, "-I", "-m", "megatron_async_rl.sandbox.reaper"]
    limits = json.dumps(dataclasses.asdict(config))
    proc = subprocess.Popen(
        [*reaper, limits, *bwrap_argv(bwrap, program, config)], stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=_PACKAGE_ROOT, env=dict(ENV),
        start_new_session=True, close_fds=True,
    )  # fmt: skip
    out, err, limit = _collect(proc, config, start)
    code = proc.wait()
    wall = time.monotonic() - start
    spent = _children_cpu_s() - cpu_before  # the reaper's, with bubblewrap's and the program's
    if limit is None and code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        if spent >= config.cpu_s * 0.9:  # what RLIMIT_CPU's signals mean
            limit = "cpu"
    text = lambda b: b.decode("utf-8", "replace")  # noqa: E731
    return SandboxResult(code, text(out), text(err), limit, wall)


def _children_cpu_s() -> float:
    """CPU seconds of this process's children waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _collect(proc, config: SandboxConfig, start: float) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr until both close, the wall limit, or the output limit."""
    chunks = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in chunks:
        selector.register(stream, selectors.EVENT_READ)
    limit = None
    try:
        while selector.get_map():
            left = start + config.wall_s - time.monotonic()
            if left <= 0:
                limit = "wall"
                break
            for key, _ in selector.select(timeout=min(left, 0.5)):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                chunks[key.fileobj] += data
            if sum(map(len, chunks.values())) > config.max_output_bytes:
                limit = "output"
                break
    finally:
        selector.close()
        if limit is not None:
            _kill(proc)
        for stream in chunks:
            stream.close()
    out, err = (bytes(chunks[s][: config.max_output_bytes]) for s in (proc.stdout, proc.stderr))
    return out, err, limit


def _kill(proc) -> None:
    """SIGTERM to the reaper (`sandbox.reaper`): it kills bubblewrap (its PID namespace dies
    with it) and reaps what was left."""
    try:
        proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


def apply_limits(config: SandboxConfig) -> None:
    """In bubblewrap's process, before it starts (`sandbox.reaper`): the rlimits, then (as
    root) the user nobody."""
    cpu = max(1, int(config.cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = config.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = config.max_file_mb << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        tasks = 0  # the sandboxes' own
    else:
        tasks = _tasks_of(os.getuid())
    nproc = tasks + config.max_processes + BWRAP_PROCESSES
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
