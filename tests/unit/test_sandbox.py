"""The sandbox (`megatron_async_rl.sandbox`) holds against a corpus of escapes, with the real
bubblewrap: each attempt is blocked or killed, comes back as a tool answer (never an exception),
and leaves no process behind; ordinary programs run and answer.

Contract, per escape: a socket to 127.0.0.1 and to an outside address (no network); a write
outside its directory (read-only system, no host files at all: not the checkout, not /root);
reading /proc/1/environ, the trainer's environment and another process's memory (its own PID
namespace, a cleared environment); a fork bomb (RLIMIT_NPROC, then the wall limit); memory
beyond the limit (MemoryError); an endless loop (the CPU limit); a signal to its parent (it has
none it can see: the caller is outside its PID namespace); a process left behind after it
returns (killed with the namespace, whose first process it was); 10 MB of output (cut at the
limit, killed).
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

from megatron_async_rl.sandbox import command
from megatron_async_rl.sandbox.config import SandboxConfig
from megatron_async_rl.sandbox.run import run_code
from megatron_async_rl.sandbox.tools import Answer, answer

pytestmark = pytest.mark.skipif(
    command.find_bwrap() is None, reason="bubblewrap is not installed (scripts/setup_env.sh)"
)
LIMITS = SandboxConfig(cpu_s=2, wall_s=6, memory_mb=256, max_processes=16,
                       max_output_bytes=65536)  # fmt: skip
SECRET = "MEGATRON_ASYNC_RL_TEST_SECRET"


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch):
    """Nothing a sandbox started outlives it (the runs below start under this process)."""
    monkeypatch.setenv(SECRET, "trainer-token-123")
    before = {p.pid for p in psutil.process_iter()}
    yield
    time.sleep(0.3)
    left = [p for p in psutil.process_iter(["cmdline"])
            if p.pid not in before and "bwrap" in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    left += [p for p in psutil.process_iter(["username"]) if p.info["username"] == "nobody"]
    assert not left, [p.pid for p in left]


def test_a_program_runs_and_answers():
    result = run_code("python", "import sys; print(sum(range(10))); print('w', file=sys.stderr)")
    assert result.ok and result.stdout == "45\n" and result.stderr == "w\n"
    text = answer(result, LIMITS)
    assert text == "exit status 0\nstdout:\n45\nstderr:\nw" and text.outcome == "ok"
    assert run_code("bash", "echo $((6*7)); exit 3").exit_code == 3


ESCAPES = {
    "socket-to-localhost": (
        "import socket\ns = socket.socket(); s.settimeout(2)\ns.connect(('127.0.0.1', 22))",
        ("Errno 101", "Errno 111", "unreachable", "refused")),
    "socket-outside": (
        "import socket\ns = socket.socket(); s.settimeout(2)\ns.connect(('1.1.1.1', 80))",
        ("Errno 101", "unreachable")),
    "write-outside-its-directory": (
        "open('/usr/escaped', 'w').write('x')", ("Read-only file system", "Permission denied")),
    "read-the-host-files": (
        "import os\nprint(os.listdir('/'))\nopen('/root/.bashrc')", ("No such file",)),
    "proc-1-environ-and-the-trainers-environment": (
        f"import os\nenv = open('/proc/1/environ').read()\nassert '{SECRET}' not in env, env\n"
        f"assert '{SECRET}' not in os.environ\nraise SystemExit('clean')", ("clean",)),
    "another-processs-memory": (
        f"import os\nopen('/proc/{os.getpid()}/mem', 'rb').read(1)",
        ("No such file", "Permission denied")),
    "signal-to-its-parent": (
        f"import os, signal\nassert os.getppid() == 0\nos.kill({os.getpid()}, signal.SIGKILL)",
        ("ProcessLookupError",)),
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_an_escape_is_blocked_and_answered(name):
    code, expected = ESCAPES[name]
    result = run_code("python", code, LIMITS)
    text = answer(result, LIMITS)
    assert isinstance(text, Answer) and result.error is None, text
    assert any(e in result.stdout + result.stderr for e in expected), (name, text)
    assert result.limit is None and result.wall_s < LIMITS.wall_s, (name, text)


def test_a_fork_bomb_is_contained_and_killed():
    result = run_code("python", "import os\nwhile True:\n    try:\n        os.fork()\n"
                      "    except OSError:\n        pass", LIMITS)  # fmt: skip
    assert result.limit in ("wall", "cpu"), result
    assert answer(result, LIMITS).outcome in ("wall", "cpu")


def test_memory_beyond_the_limit_fails_inside():
    result = run_code("python", "x = bytearray(512 << 20)", LIMITS)
    assert result.exit_code == 1 and "MemoryError" in result.stderr, result


def test_an_endless_loop_hits_the_cpu_limit():
    result = run_code("python", "while True:\n    pass", LIMITS)
    assert result.limit == "cpu" and result.wall_s < LIMITS.wall_s, result
    assert "CPU-time limit (2 s)" in answer(result, LIMITS)


def test_a_process_left_behind_dies_with_the_sandbox():
    result = run_code("bash", "sleep 300 & echo started $!", LIMITS)
    assert result.ok and result.stdout.startswith("started"), result
    # (`no_leftovers` checks that the sleep is gone)


def test_ten_megabytes_of_output_are_cut_and_the_program_killed():
    result = run_code("python", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
                      LIMITS)  # fmt: skip
    assert result.limit == "output" and len(result.stdout) <= LIMITS.max_output_bytes, result.limit
    assert "more than 65536 bytes" in answer(result, LIMITS)


def test_a_sleeping_program_hits_the_wall_limit():
    result = run_code("bash", "sleep 100", SandboxConfig(wall_s=1))
    assert result.limit == "wall" and result.wall_s < 3, result


def test_without_bubblewrap_the_answer_says_so(monkeypatch):
    monkeypatch.setattr(command, "find_bwrap", lambda: None)
    from megatron_async_rl.sandbox import run as run_module

    monkeypatch.setattr(run_module, "find_bwrap", lambda: None)
    text = answer(run_code("python", "print(1)"), LIMITS)
    assert text.outcome == "unavailable" and "bubblewrap (bwrap) is not installed" in text


def test_the_builtin_tools_run_through_the_tool_workers_and_are_counted(monkeypatch):
    """`environment.tools: [python, bash]`: described to the chat template, run by the tool
    workers in the sandbox, each outcome the model's answer and counted by kind."""
    import json

    from megatron_async_rl.rollout.tool_calls import ToolCall
    from megatron_async_rl.rollout.tools import ToolRunner, load_tools
    from megatron_async_rl.sandbox.tools import ENV_VAR

    monkeypatch.setenv(ENV_VAR, json.dumps({"wall_s": 99}))  # the recipe's limits win
    tools = load_tools(["python", "bash"])
    assert sorted(tools) == ["bash", "python"]
    assert tools["python"].schema["function"]["parameters"]["required"] == ["code"]
    limits = SandboxConfig(wall_s=4, cpu_s=1)  # environment.sandbox
    runner = ToolRunner(tools, workers=2, timeout_s=10.0, sandbox=limits)
    try:
        out = runner.run([
            ToolCall("python", {"code": "print(2 ** 10)"}),
            ToolCall("bash", {"script": "echo no >&2; exit 4"}),
            ToolCall("python", {"code": "while True: pass"}),
            ToolCall("bash", {"script": "sleep 30"}),  # (no CPU: the wall limit)
        ])  # fmt: skip
    finally:
        runner.close()
    assert out[0] == "exit status 0\nstdout:\n1024"
    assert out[1] == "exit status 4\nstderr:\nno"
    assert out[2].startswith("error: the program used its CPU-time limit (1 s)")
    assert out[3].startswith("error: the program ran past its wall-time limit (4 s)")
    assert {k: v for k, v in runner.counts.items() if k.startswith("sandbox_")} == {
        "sandbox_ok": 1, "sandbox_exit_nonzero": 1, "sandbox_cpu": 1, "sandbox_wall": 1}
