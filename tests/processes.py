"""Process listings for tests that tolerate what a listing can meet: a child that exited and is
not yet reaped (a zombie: psutil raises ZombieProcess for its command line) or one that is gone
between the listing and the look (NoSuchProcess)."""

from __future__ import annotations

import psutil


def cmdline(process: psutil.Process) -> str:
    """The command line, joined; "" for a zombie or a process that is gone."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
