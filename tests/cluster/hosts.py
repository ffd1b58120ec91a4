"""Two hosts on one machine: network namespaces joined by a veth pair, each with its own
hostname, address and /dev/shm (measured in `shared/facts/slurm_ci.md`).

`TwoHosts(tag)` creates namespaces `mar-<tag>-a` and `mar-<tag>-b` with addresses
10.231.<n>.1 and .2 on the pair; `popen(i, argv, env)` starts a process on host i inside
`unshare --uts --mount` so it sees its own hostname, a fresh tmpfs on /dev/shm and an /etc/hosts
naming both hosts (as a cluster's DNS would; torch's rendezvous resolves hostnames); `close()`
removes everything. `CannotRun` says why this machine cannot do it (the tests skip with it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

SUBNET = "10.231"


class CannotRun(RuntimeError):
    """This machine cannot build the two hosts (the reason is the message)."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class TwoHosts:
    def __init__(self, tag: int):
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            raise CannotRun("two hosts need root, `ip` (iproute2) and `unshare`")
        self.names = (f"mar-{tag}-a", f"mar-{tag}-b")
        taken = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        if any(name in taken.split() for name in self.names):  # another session's: not ours
            raise CannotRun(f"namespaces {self.names} exist already")
        self.hostnames = ("host-a", "host-b")
        self.ifaces = (f"mar{tag}a", f"mar{tag}b")
        net = tag % 250 + 1
        self.addrs = (f"{SUBNET}.{net}.1", f"{SUBNET}.{net}.2")
        try:
            for name in self.names:
                _ip("netns", "add", name)
            _ip("link", "add", self.ifaces[0], "type", "veth", "peer", "name", self.ifaces[1])
            for name, iface, addr in zip(self.names, self.ifaces, self.addrs):
                _ip("link", "set", iface, "netns", name)
                _ip("-n", name, "addr", "add", f"{addr}/24", "dev", iface)
                _ip("-n", name, "link", "set", iface, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except RuntimeError as err:
            self.close()
            raise CannotRun(f"cannot build network namespaces: {err}") from err
        self._dir = tempfile.TemporaryDirectory(prefix="two-hosts-")
        self.etc_hosts = Path(self._dir.name) / "hosts"
        names = "".join(f"{a} {h}\n" for a, h in zip(self.addrs, self.hostnames))
        self.etc_hosts.write_text(f"127.0.0.1 localhost\n{names}")

    def popen(self, host: int, argv: list[str], env: dict, **kwargs) -> subprocess.Popen:
        """Start `argv` on `host` (0 or 1): its hostname, its network, its own /dev/shm."""
        inner = (
            f"hostname {self.hostnames[host]} && mount -t tmpfs -o size=4g tmpfs /dev/shm && "
            f"mount --bind {self.etc_hosts} /etc/hosts && exec {shlex.join(argv)}"
        )
        cmd = ["ip", "netns", "exec", self.names[host], "unshare", "--uts", "--mount",
               "--fork", "bash", "-c", inner]  # fmt: skip
        return subprocess.Popen(cmd, env=env, **kwargs)

    def close(self) -> None:
        if hasattr(self, "_dir"):
            self._dir.cleanup()
        for name in self.names:  # deleting a namespace deletes its end of the pair too
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
