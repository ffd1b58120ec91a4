"""The tests' process listings (`tests/processes.py`) tolerate a real zombie: a child that has
exited and is not yet reaped (what a killed pool worker is for a moment). Nothing is faked."""

import subprocess
import sys
import time

import psutil

from tests.processes import alive, cmdline


def test_a_zombie_child_has_an_empty_command_line_and_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        process = psutil.Process(child.pid)
        deadline = time.monotonic() + 30
        while process.status() != psutil.STATUS_ZOMBIE:  # exited, not reaped: Popen not polled
            assert time.monotonic() < deadline, process.status()
            time.sleep(0.05)
        try:
            process.cmdline()
            raised = False
        except psutil.ZombieProcess:
            raised = True
        # the listing that failed before: cmdline() raises on a zombie on Linux
        assert raised
        assert cmdline(process) == ""
        assert not alive(process)
    finally:
        child.wait()
    assert cmdline(process) == "" and not alive(process)  # reaped: gone
