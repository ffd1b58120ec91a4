"""`checkpoint.megatron_state.start_write_queue` survives a preemption signal while it starts.

Contract checked, with real processes (nothing faked): torchrun sends SIGTERM to a rank's whole
process group, once; megatron-core's writer Manager server, spawned at a rank's first save,
dies of it while it is still being spawned (before its initializer can ignore it). A thread
SIGTERMs the children of this process as soon as one appears (once); the start still
succeeds (a second server), the queue works, and the server ignores SIGTERM afterwards. Fails
without the retry (EOFError).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

from megatron_async_rl.checkpoint import megatron_state


def test_the_writer_server_survives_sigterm_while_it_is_spawned():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    me, stop, hit = psutil.Process(), threading.Event(), set()
    before = {p.pid for p in me.children(recursive=True)}

    def sigterm_new_children():  # once, to all of them: what torchrun does to the group
        while not stop.is_set() and not hit:
            for child in me.children(recursive=True):
                if child.pid not in before:
                    try:
                        child.send_signal(signal.SIGTERM)
                        hit.add(child.pid)
                    except psutil.Error:
                        pass
            time.sleep(0.005)

    thread = threading.Thread(target=sigterm_new_children, daemon=True)
    thread.start()
    try:
        megatron_state.start_write_queue()
        time.sleep(0.5)  # signals keep coming once it is up
    finally:
        stop.set()
        thread.join()
    try:
        assert hit, "no child was signalled: the test did not test anything"
        queue = filesystem_async._results_queue
        queue.put("written")
        assert queue.get(timeout=10) == "written"
        server = queue._manager._process
        assert server.is_alive()
        os.kill(server.pid, signal.SIGTERM)
        time.sleep(0.3)
        assert server.is_alive()
    finally:
        megatron_state.stop_write_queue()
