"""The bubblewrap command line of one sandboxed program. Pure: no process is started here.

What the program sees: the system (`/usr`, `/etc`, and `/bin`, `/lib`, `/lib64`, `/sbin` as the
links Debian makes them) read-only; a private `/tmp` (tmpfs, its size bounded) as its working
directory, the only place it may write; its own `/proc` and `/dev`; no network (a namespace of
its own with no interface up, loopback included); its own PID namespace (it cannot see or
signal any process outside, the trainer's included; when its first process ends, or the sandbox
is killed, every process in it dies with it); no environment but `PATH`, `HOME` and `LANG`; no
way to make user namespaces of its own. Not the host's home, the checkout, its checkpoints or
the run's files.
"""

from __future__ import annotations

import os
import shutil

from megatron_async_rl.sandbox.config import SandboxConfig

SYSTEM_DIRS = ("/usr", "/etc")
LINKS = {"/bin": "usr/bin", "/lib": "usr/lib", "/lib64": "usr/lib64", "/sbin": "usr/sbin"}
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
INTERPRETERS = {"python": ("/usr/bin/python3", "-I", "-c"), "bash": ("/bin/bash", "-c")}
"""Built-in languages: the system's interpreters (isolated mode for Python: no user site, no
PYTHON* variables, no script directory on sys.path)."""


def find_bwrap() -> str | None:
    return shutil.which("bwrap")


def bwrap_argv(bwrap: str, program: list[str], config: SandboxConfig) -> list[str]:
    """`program` (argv inside the sandbox) run by `bwrap` under `config`."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    argv += ["--new-session", "--as-pid-1", "--hostname", "sandbox", "--clearenv"]
    for key, value in ENV.items():
        argv += ["--setenv", key, value]
    for path in SYSTEM_DIRS:
        if os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for link, target in LINKS.items():
        if os.path.islink(link) or os.path.isdir(os.path.join("/", target)):
            argv += ["--symlink", target, link]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", str(config.max_file_mb * 4 << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]
    return [*argv, "--", *program]


def program_for(language: str, code: str) -> list[str]:
    """The argv inside the sandbox that runs `code` in `language` (one of `INTERPRETERS`)."""
    if language not in INTERPRETERS:
        raise ValueError(f"unknown language {language!r} (known: {', '.join(INTERPRETERS)})")
    return [*INTERPRETERS[language], code]
