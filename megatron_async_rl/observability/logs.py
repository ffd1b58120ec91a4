"""Logging with a role/rank prefix on every line, and the leader's console output.

Owned here: the one logging setup of a rank (called by the entry point as soon as the rank and
its roles are known) and `leader_print`, the only way the package writes to stdout (rank 0).
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s [%(prefix)s] %(levelname)s %(name)s: %(message)s"


class _PrefixFilter(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        record.prefix = self.prefix
        return True


def setup_logging(rank: int | None = None, roles: tuple[str, ...] = (), level: str | None = None):
    """(Re)configure the root logger: `[train+logp r3]`-style prefixes, INFO by default.

    Only rank 0 logs INFO unless MEGATRON_ASYNC_RL_LOG_ALL_RANKS=1; other ranks log warnings.
    """
    level = level or os.environ.get("MEGATRON_ASYNC_RL_LOG_LEVEL", "INFO")
    prefix = ("+".join(roles) or "launcher") + ("" if rank is None else f" r{rank}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_PrefixFilter(prefix))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    quiet = rank not in (None, 0) and os.environ.get("MEGATRON_ASYNC_RL_LOG_ALL_RANKS") != "1"
    root.setLevel(logging.WARNING if quiet else level)
    for noisy in ("megatron", "torch.distributed", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def leader_print(text: str, rank: int | None = 0) -> None:
    """Write user-facing output to stdout on rank 0 (or outside a distributed run)."""
    if rank in (None, 0):
        sys.stdout.write(text.rstrip("\n") + "\n")
        sys.stdout.flush()
