"""Ctrl-C and the save-and-exit signals as `checkpoint.manager.SignalFlag` takes them.

Contract: the first SIGINT sets the flag (`code()` STOP: save at the next boundary, exit 130);
the same keypress arriving again within `REPEAT_S` (from the terminal and from torchrun's
agent) is ignored; a second Ctrl-C after that raises KeyboardInterrupt (stop at once); a
save-and-exit signal (SIGTERM here) wins over Ctrl-C (`code()` SAVE: exit 83). Real signals to
this process.
"""

import os
import signal

import pytest

from megatron_async_rl.checkpoint.manager import SignalFlag


@pytest.fixture(autouse=True)
def _restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_ctrl_c_once_stops_at_the_boundary_twice_stops_now(monkeypatch):
    flag = SignalFlag([])
    assert flag.code() == 0
    os.kill(os.getpid(), signal.SIGINT)
    assert flag.raised == "SIGINT" and flag.code() == SignalFlag.STOP
    os.kill(os.getpid(), signal.SIGINT)  # the same keypress, relayed by torchrun: ignored
    assert flag.code() == SignalFlag.STOP
    flag._interrupted_at -= SignalFlag.REPEAT_S + 0.1  # a second keypress, later
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_a_save_signal_wins_over_ctrl_c():
    flag = SignalFlag(["SIGTERM"])
    os.kill(os.getpid(), signal.SIGINT)
    assert flag.code() == SignalFlag.STOP
    os.kill(os.getpid(), signal.SIGTERM)
    assert flag.raised == "SIGTERM" and flag.code() == SignalFlag.SAVE
