"""`name_failure` names collective failures only, and its error survives pickling.

Contract: errors that are not a collective's (a `StageTimeout`, a ValueError, an engine's
timeout text) pass through unchanged; a gloo-style RuntimeError becomes a `CollectiveFailure`
naming the context, the call and its site; `CollectiveFailure` pickles (it crosses process
boundaries in reports). The real failures (a peer killed, a peer stopped) are in
tests/distributed/test_collective_faults.py.
"""

from __future__ import annotations

import pickle

from megatron_async_rl.distributed.collective_errors import CollectiveFailure, name_failure
from megatron_async_rl.scheduler.states import StageTimeout


def _raise(err):
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001
        return caught


def test_other_errors_pass_through():
    context = {"role": "train", "rank": 0, "stage": "train"}
    for err in (
        StageTimeout("samples of step 3", 10.0, 10.0, context),
        ValueError("bad value"),
        RuntimeError("SGLang engine did not answer generate within 30 s"),
    ):
        assert name_failure(_raise(err), context) is err


def test_gloo_errors_are_named_and_pickle():
    err = _raise(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    named = name_failure(err, {"role": "logp", "rank": 3, "stage": "logp"})
    assert isinstance(named, CollectiveFailure)
    assert str(named).startswith("role logp, rank 3, stage logp: collective ")
    assert "test_collective_errors.py" in str(named) and "Connection closed by peer" in str(named)
    assert name_failure(named, {}) is named  # named once
    again = pickle.loads(pickle.dumps(named))
    assert str(again) == str(named)
