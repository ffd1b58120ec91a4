"""One rank's pipeline state in a checkpoint: random generators and what its sides carry.

Owned here: `rng_state` / `set_rng_state` (Python, NumPy, torch's CPU generator, CUDA's when
in use, and Megatron's model-parallel RNG tracker) and `rank_state` / `restore_rank_state`
(the dict a rank writes as `rank_<r>.pt`: the version, its RNGs, the generate side's prompt
cursor, reward counters and, in the asynchronous loop, its untrained steps (`pending`), the
learn side's counters). Called by `checkpoint.manager`.

Restoring: a rank's own file when the saved world had the same size (its RNGs included); the
prompt cursor is the same on every engine host (they all draw the same prompts), so with
another world size the position of the version's first prompt is taken from any engine host's
file (the asynchronous loop's untrained steps are then generated again), and RNGs are seeded
afresh from the run seed, the version and the rank (stated in the resume record).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    tracker = _megatron_tracker()
    if tracker is not None:
        state["megatron"] = tracker.get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = _megatron_tracker()
    if tracker is not None and "megatron" in state:
        tracker.set_states(state["megatron"])


def reseed(seed: int, version: int, rank: int) -> None:
    """Fresh generators for a rank whose saved RNGs cannot be matched (another world size)."""
    value = (seed * 1_000_003 + version * 7919 + rank) % (2**31)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def _megatron_tracker():
    try:
        from megatron.core.tensor_parallel import random as mc_random
    except ImportError:
        return None
    tracker = mc_random.get_cuda_rng_tracker()
    return tracker if tracker.get_states() else None


def rank_state(version: int, gen, learn, pending=None, extra=None) -> dict[str, Any]:
    """What this rank writes (its sides: `gen` and/or `learn`, None where absent; `pending`,
    the asynchronous engine host's `PendingSteps`, and `extra`, more of its generate state)."""
    state: dict[str, Any] = {"version": version, "rng": rng_state()}
    if gen is not None:
        cursor = gen.dataset.state_dict()
        first = pending.first_cursor() if pending is not None else None
        state["gen"] = {
            "cursor": cursor,  # where this rank's data continues
            # where step `version`'s prompts start (another world size regenerates from it)
            "version_cursor": cursor if first is None else {**cursor, "cursor": first},
            "reward": {"errors": gen.reward.errors, "calls": gen.reward.calls},
        }
        if pending is not None:
            state["gen"]["pending"] = pending.state_dict()
        state["gen"].update(extra or {})
    if learn is not None:
        state["learn"] = {"logp_version": learn.logp_version}
    return state


def restore_rank_state(state: dict[str, Any] | None, cursor, gen, learn) -> None:
    """Restore from this rank's own saved `state` (None: another world size saved it: only
    the shared `cursor`, fresh RNGs)."""
    if gen is not None and cursor is not None:
        gen.dataset.load_state_dict(cursor)
    if state is None:
        return
    set_rng_state(state["rng"])
    if gen is not None and "gen" in state:
        gen.reward.errors = state["gen"]["reward"]["errors"]
        gen.reward.calls = state["gen"]["reward"]["calls"]
    if learn is not None and "learn" in state:
        learn.logp_version = state["learn"]["logp_version"]
