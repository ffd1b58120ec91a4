"""Run a program in the sandbox (`command.bwrap_argv`) under resource limits; never raises for
what the program does: every outcome is a `SandboxResult`.

The program's parent is a small reaper (`sandbox.reaper`), so that nothing is left as a zombie.
Limits: CPU seconds, address space, open files, file size and processes are rlimits set by the
reaper before bubblewrap starts (`reaper.apply_limits`, inherited by everything inside); wall
time and output size are watched here, and at either limit the whole sandbox is killed (its
session, and with it its PID namespace).
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

REAPER = str(Path(__file__).with_name("reaper.py"))
"""Run by its path, standard library only (`python -I -S`): its start-up is part of every run."""


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
    reaper = [sys.executable, "-I", "-S", REAPER]
    limits = json.dumps(dataclasses.asdict(config))
    proc = subprocess.Popen(
        [*reaper, limits, *bwrap_argv(bwrap, program, config)], stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", env=dict(ENV),
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
