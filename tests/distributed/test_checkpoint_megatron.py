"""The train role's model, optimizer and lr schedule through a checkpoint, across layouts.

Contract (real megatron-core on gloo ranks, dist_checkpointing's own files): a train role with
the distributed optimizer and a cosine lr decay over 4 steps takes one Adam step, is saved with
TP=2 (`save_train_state`), and takes a second step; a new world loads the checkpoint
(`load_train_state`) with the same layout and with TP=1 x PP=2, and takes the same second step.
The loaded weights equal the saved ones bit for bit; after the second step the same layout
equals the uninterrupted run bit for bit, and the other layout within 1e-6 (fp32; a different
reduction order). This pins the optimizer state (moments and per-parameter step counts:
`megatron_state`'s workarounds) and the lr schedule (its step count, every param group's lr,
the lr the second step reports: not the first step's again) across a resume.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness.checkpoints import (
    checkpoint_role,
    checkpoint_step,
    exported_weights,
    load_worker,
    save_worker,
)
from tests.harness.ranks import spawn


@pytest.fixture(scope="module")
def llama_path(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, llama_path):
    root = tmp_path_factory.mktemp("ckpt")
    (root / "save").mkdir()
    results = spawn(save_worker, 2, root / "save", str(llama_path), str(root / "ckpt"))
    return root, next(r for r in results if r[0] is not None)


@pytest.mark.parametrize(
    ("name", "parallel", "tolerance"),
    [("tp2", {"tensor_model_parallel_size": 2}, 0.0),
     ("pp2", {"pipeline_model_parallel_size": 2}, 1e-6)],
)  # fmt: skip
def test_resume_continues_the_optimizer_in_any_layout(saved, llama_path, name, parallel, tolerance):
    root, (at_save, uninterrupted, (schedule, second_lr)) = saved
    (root / name).mkdir()
    results = spawn(load_worker, 2, root / name, str(llama_path), str(root / "ckpt"), parallel)
    loaded, after, (loaded_schedule, loaded_lr) = next(r for r in results if r[0] is not None)
    for key, tensor in at_save.items():
        assert torch.equal(loaded[key], tensor), key
    worst = max((after[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
    moved = max((after[k] - at_save[k]).abs().max().item() for k in at_save)
    assert worst <= tolerance and moved > 1e-4, (worst, moved)
    # Cosine over 4 steps, at step 1: the lr of the step after the save, in every param group.
    assert schedule[0] == 1 and second_lr == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert loaded_schedule == (1, [second_lr] * len(loaded_schedule[1])), loaded_schedule
    assert loaded_lr == second_lr


def _async_save_worker(rank, world_size, tmp_dir, path, ckpt):
    from pathlib import Path

    from megatron_async_rl.checkpoint.megatron_state import AsyncWriter, save_train_state

    role = checkpoint_role(world_size, path, {"tensor_model_parallel_size": 2})
    checkpoint_step(role, 0)
    writer = AsyncWriter()
    save_train_state(role, Path(ckpt), writer)
    saved = exported_weights(role)
    checkpoint_step(role, 1)  # while the forked process writes: it must still write the saved state
    assert writer.finish(blocking=True)
    return saved, exported_weights(role)


def test_an_asynchronous_save_writes_the_state_of_its_snapshot(saved, llama_path, tmp_path):
    """`AsyncWriter`: the second step runs while the forked process writes; the checkpoint
    still holds the state at the save, and resuming from it takes the same second step."""
    _, (at_save, uninterrupted, _) = saved  # the synchronous save's run: the same two steps
    (tmp_path / "save").mkdir()
    (tmp_path / "load").mkdir()
    ckpt = str(tmp_path / "ckpt")
    results = spawn(_async_save_worker, 2, tmp_path / "save", llama_path, ckpt)
    at_async_save, _ = next(r for r in results if r[0] is not None)
    results = spawn(load_worker, 2, tmp_path / "load", llama_path, ckpt,
                    {"tensor_model_parallel_size": 2})  # fmt: skip
    loaded, after, _ = next(r for r in results if r[0] is not None)
    for key, tensor in at_async_save.items():
        assert torch.equal(tensor, at_save[key]) and torch.equal(loaded[key], tensor), key
    assert all(torch.equal(after[k], uninterrupted[k]) for k in uninterrupted)


def _hung_writer_worker(rank, world_size, tmp_dir, path, ckpt):
    import os
    import signal
    import time
    from pathlib import Path

    import psutil

    from megatron_async_rl.checkpoint.megatron_state import AsyncWriter, save_train_state

    role = checkpoint_role(world_size, path, {"tensor_model_parallel_size": 2})
    checkpoint_step(role, 0)
    writer = AsyncWriter()
    before = {p.pid for p in psutil.Process().children()}
    save_train_state(role, Path(ckpt), writer)
    forked = [p for p in psutil.Process().children() if p.pid not in before]
    for child in forked:  # the rank's forked writer, stopped mid-write
        os.kill(child.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        writer.finish(blocking=True, timeout_s=3.0)
    except RuntimeError as err:
        message = str(err)
    else:
        message = "finished"
    for child in forked:
        os.kill(child.pid, signal.SIGKILL)
    return len(forked), message, time.monotonic() - start


def test_a_hung_background_writer_ends_the_save_with_an_error(llama_path, tmp_path):
    """SIGSTOP of each rank's forked writer: `finish` gives up on every rank after its timeout
    with an error naming the cause (megatron-core alone would wait forever)."""
    results = spawn(_hung_writer_worker, 2, tmp_path, llama_path, str(tmp_path / "ckpt"))
    for forked, message, waited in results:
        assert forked >= 1 and "did not finish within 3 s" in message, (forked, message)
        assert waited < 60, waited
    # The ranks vote: all give up once the first one's 3 s are over, which a rank that entered
    # `finish` a little later sees as slightly less (seen: 2.998 s).
    assert max(r[2] for r in results) >= 3.0, results
