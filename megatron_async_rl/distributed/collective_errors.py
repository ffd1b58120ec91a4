"""Name the collective behind a distributed failure: role, rank, stage, the call and its site.

torch.distributed reports a peer that died inside a collective as gloo's "Connection closed by
peer" (at once) and one that hangs as "Timed out waiting ...ms" (after the group's timeout,
`ResolvedConfig.collective_timeout_s`); neither says which of our calls it was. Every thread
that runs collectives (the scheduler's work on the main thread, the weight and sample threads)
passes what it raises through `name_failure`, which walks the traceback to the torch.distributed
entry point (`all_reduce`, `broadcast`, ...) or, for an asynchronous handle, the line that waited
on it, and raises `CollectiveFailure` naming both, chained to the original error. `stalled_in`
does the same for a live thread's stack (the step watchdog's report). Pure: imports no torch.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from types import FrameType
from typing import Any

_TORCH_DIST = "/torch/distributed/"
_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "/gloo/",
    "NCCL error",
    "ProcessGroupNCCL",
)
"""Text of the errors gloo and NCCL raise from a collective (on older torch they are plain
RuntimeErrors, not `DistError`)."""


class CollectiveFailure(RuntimeError):
    """A collective failed: who (role, rank, stage), which call and where, and what torch said."""

    def __init__(self, context: Mapping[str, Any], collective: str, site: str, cause: str):
        self.context, self.collective = dict(context), collective
        self.site, self.cause = site, cause
        who = ", ".join(f"{key} {value}" for key, value in self.context.items())
        super().__init__(
            f"{who}: collective {collective} failed ({site}): a peer rank died, or hung past "
            f"the process groups' timeout (scheduler.stage_timeout_s, or platform.timeout_s / "
            f"--distributed-timeout-minutes where set); torch.distributed said: {cause}"
        )

    def __reduce__(self):
        return (CollectiveFailure, (self.context, self.collective, self.site, self.cause))


def is_collective_failure(err: BaseException) -> bool:
    if isinstance(err, CollectiveFailure):
        return False  # named already
    if any(cls.__name__ == "DistError" for cls in type(err).__mro__):  # torch's, unimported
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _MARKERS)


def _in_collective(frames: list[traceback.FrameSummary]) -> tuple[str, str] | None:
    """(torch.distributed call, its call site) of frames ordered outermost first, if they
    enter torch.distributed."""
    for index, frame in enumerate(frames):
        if _TORCH_DIST not in frame.filename.replace("\\", "/"):
            continue
        # The API function (decorators such as c10d_logger's `wrapper` come first).
        api = next((f for f in frames[index:] if f.filename.endswith("distributed_c10d.py")), frame)
        caller = frames[index - 1] if index else frame
        return f"torch.distributed.{api.name}", _site(caller)
    return None


def _innermost(frames: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(the innermost line, quoted, and its site): where no torch.distributed frame is (an
    async handle's wait() runs in C++)."""
    last = frames[-1]
    return f"`{(last.line or '').strip() or last.name}`", _site(last)


def _site(frame: traceback.FrameSummary) -> str:
    path = frame.filename.replace("\\", "/")
    for root in ("/megatron_async_rl/", "/megatron/"):
        if root in path:
            path = root.strip("/") + "/" + path.split(root, 1)[1]
            break
    return f"called in {frame.name} at {path}:{frame.lineno}"


def name_failure(err: BaseException, context: Mapping[str, Any]) -> BaseException:
    """`err` as a `CollectiveFailure` naming `context` (role, rank, stage) and the collective,
    chained to `err` (`__cause__`), when it is a collective's failure; else `err` itself."""
    if not is_collective_failure(err):
        return err
    frames = traceback.extract_tb(err.__traceback__)
    found = _in_collective(frames) or (_innermost(frames) if frames else None)
    collective, site = found or ("(unknown)", "no traceback")
    named = CollectiveFailure(context, collective, site, str(err).splitlines()[0][:400])
    named.__cause__ = err
    return named


def stalled_in(frame: FrameType | None) -> str:
    """Where a live thread stands: the collective it is in, if any, else its innermost line."""
    if frame is None:
        return "(thread gone)"
    frames = traceback.extract_stack(frame)
    found = _in_collective(frames)
    if found is not None:
        return f"collective {found[0]} ({found[1]})"
    return "{} ({})".format(*_innermost(frames))
