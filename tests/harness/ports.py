"""A TCP port the OS says is free, for a test that starts something listening on one.

Every test that needs a port (torchrun's `MASTER_PORT`, a rendezvous endpoint, a store) takes it
from `free_port`, never a number written in the test: two runs that overlap (two sessions on one
machine, two tests of one session) would otherwise race for the same port.
`tests/unit/test_test_tree.py` rejects a port literal in a test module.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """Bind port 0 on `host`, close, and return the port the OS chose (free a moment ago)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
