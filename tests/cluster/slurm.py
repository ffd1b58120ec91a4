"""A real single-node SLURM for tests: munge, slurmctld and slurmd from Debian's packages.

`SlurmCluster(root).start()` installs the packages where they are missing (apt-get, root only),
starts munged as the `munge` user, writes a slurm.conf whose state and spool directories live
under `root`, starts slurmctld and `slurmd -N localhost` as plain daemons and waits for the node
to be idle; `stop()` ends them by the PIDs they wrote. `CannotRun` says why a machine cannot
host it (the tests skip with that reason). What works and what fails silently was measured in
`shared/facts/slurm_ci.md` (proctrack/linuxproc, RealMemory from `slurmd -C`, EnforcePartLimits).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PORTS = (6817, 6818)


class CannotRun(RuntimeError):
    """This machine cannot host the test cluster (the reason is the message)."""


def _run(*cmd: str, timeout: float = 120, **kwargs) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def install() -> None:
    """apt-get the packages where a binary is missing; CannotRun where that is impossible."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise CannotRun("SLURM is not installed and installing it needs root")
    if shutil.which("apt-get") is None:
        raise CannotRun("SLURM is not installed and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        _run("apt-get", "install", "-y", "--no-install-recommends", *PACKAGES, env=env,
             timeout=600)  # fmt: skip
    except RuntimeError:
        try:  # a stale package index: refresh it once
            _run("apt-get", "update", env=env, timeout=600)
            _run("apt-get", "install", "-y", "--no-install-recommends", *PACKAGES, env=env,
                 timeout=600)  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            raise CannotRun(f"cannot install SLURM with apt-get: {err}") from err


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._pidfiles = [self.root / "slurmctld.pid", self.root / "slurmd.pid"]
        self._pids: list[int] = []
        self._munged: int | None = None

    def start(self) -> SlurmCluster:
        install()
        busy = [p for p in PORTS if _port_busy(p)]
        if busy:
            raise CannotRun(f"ports {busy} are in use: another slurmctld/slurmd runs here")
        self.root.mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self.conf.write_text(self._config())
        _run("slurmctld", "-f", str(self.conf), env=self.env)
        _run("slurmd", "-f", str(self.conf), "-N", "localhost", env=self.env)
        self._pids = [int(p.read_text()) for p in self._wait_for(self._pidfiles)]
        deadline = time.monotonic() + 60
        while "idle" not in self.sinfo():
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the SLURM node never became idle: {self.sinfo()}")
            time.sleep(0.2)
        return self

    def sinfo(self) -> str:
        return _run("sinfo", "-h", "-o", "%T %E", env=self.env).strip()

    def _start_munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o600)
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        sock = run_dir / "munge.socket.2"
        if not _accepts(sock):  # started here: stopped with the rest
            # A munged that died (SIGKILL, a machine image saved while it ran) leaves its socket
            # behind; munged refuses to start over it without --force.
            _run("runuser", "-u", "munge", "--", "munged", "--force")
            self._wait_for([sock], nonempty=False)
            deadline = time.monotonic() + 30
            while not _accepts(sock):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"munged started but {sock} refuses connections")
                time.sleep(0.1)
            pidfile = run_dir / "munged.pid"
            if pidfile.exists():
                self._munged = int(pidfile.read_text())

    def _config(self) -> str:
        node = _run("slurmd", "-C").splitlines()[0]  # NodeName=... CPUs=... RealMemory=...
        fields = dict(item.split("=", 1) for item in node.split() if "=" in item)
        state, spool = self.root / "state", self.root / "spool"
        state.mkdir(exist_ok=True)
        spool.mkdir(exist_ok=True)
        return "\n".join([
            "ClusterName=test", "SlurmctldHost=localhost", "SlurmUser=root", "AuthType=auth/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "EnforcePartLimits=ALL", "MinJobAge=5", "MailProg=/bin/true",
            "ReturnToService=2", "SchedulerType=sched/backfill",
            f"StateSaveLocation={state}", f"SlurmdSpoolDir={spool}",
            f"SlurmctldPidFile={self._pidfiles[0]}", f"SlurmdPidFile={self._pidfiles[1]}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'slurmd.log'}",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={fields['CPUs']} "
            f"RealMemory={fields['RealMemory']} State=UNKNOWN",
            "PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
            "",
        ])  # fmt: skip

    @staticmethod
    def _wait_for(paths: list[Path], timeout: float = 30, nonempty=True) -> list[Path]:
        deadline = time.monotonic() + timeout
        while not all(p.exists() and (p.stat().st_size or not nonempty) for p in paths):
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemons did not write {[str(p) for p in paths]}")
            time.sleep(0.1)
        return paths

    def stop(self) -> None:
        """SIGTERM the daemons by the PIDs they wrote at start, SIGKILL after 10 s."""
        for pid in self._pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in self._pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self._pids:
            _signal(pid, signal.SIGKILL)
        self._pids = []
        if self._munged is not None:
            _signal(self._munged, signal.SIGTERM)
            self._munged = None


def _accepts(sock: Path) -> bool:
    """A daemon listens on this Unix socket (a stale socket file refuses the connection)."""
    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(str(sock)) == 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited daemon lingers as one briefly)."""
    try:
        stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
    except OSError:
        return False
    return bool(stat) and not stat.startswith("Z")
