"""The parent of one bubblewrap run: `python -m megatron_async_rl.sandbox.reaper LIMITS-JSON
BWRAP-ARGV...` (LIMITS-JSON: a `SandboxConfig`'s fields).

It makes itself the child subreaper of its subtree, runs bubblewrap under the limits
(`run.apply_limits`: rlimits, and the user nobody when run as root), and once it has ended
waits for every process left under it, so that the sandbox's processes (killed with its PID
namespace) are reaped here, not left as zombies where the host's init does not reap (a
container without one). SIGTERM (the caller's wall or output limit) kills bubblewrap at once.
Exits with bubblewrap's status (128 + N for a signal N).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    from megatron_async_rl.sandbox.config import SandboxConfig
    from megatron_async_rl.sandbox.run import apply_limits

    config = SandboxConfig(**json.loads(argv[0]))
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    child = subprocess.Popen(argv[1:], preexec_fn=lambda: apply_limits(config))
    signal.signal(signal.SIGTERM, lambda *_: child.kill())
    code = child.wait()
    while True:  # everything left under this process: the sandbox's, killed with it
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
