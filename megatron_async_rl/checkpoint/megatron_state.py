"""The train role's model, optimizer and lr schedule in a checkpoint, with megatron-core's
`dist_checkpointing`.

Owned here: `save_train_state` and `load_train_state`. Called by `checkpoint.manager` on every
rank of the world (dist_checkpointing's save and load are collectives over the default group;
ranks without the train role take part with an empty state; its common part is written by
global rank 0, which must hold the train role: `manager.check_can_save`).

Format: the model's sharded state dict and the distributed optimizer's in its
"fully_reshardable" form (every optimizer state tensor in model space, like the parameters),
so a checkpoint saved with one TP/PP/EP/DP layout loads into another. The lr schedule
(`OptimizerParamScheduler.state_dict()`, `SCHEDULER`) is in the common part; a checkpoint
without it (written before it was saved) loads with the schedule at step 0
(`roles.lr_schedule.load_scheduler_state`, which also applies --override-opt-param-scheduler
and --use-checkpoint-opt-param-scheduler).

Under --use-torch-fsdp2 (`models.torch_fsdp2`) the parameters are DTensors: each rank writes
its shard, the SwiGLU rows where DDP's layout has them (`megatron_fixes.fsdp2_row_shards`), and
the plain optimizer's state in model space; the loaded shards become DTensors again. Such a
checkpoint loads into DDP without the distributed optimizer and back (not into the distributed
optimizer's format, nor from it: another optimizer format; a resume across them is refused
before the load by the manifest's `train.optimizer_format`, `store.compatibility_keys`).

Two workarounds for megatron-core 0.16.1 with torch's own Adam (no Apex, no Transformer Engine:
the CPU path), checked by `tests/distributed/test_checkpoint_megatron.py`:
- a fresh `DistributedOptimizer` has no state, and its `state_dict()` (called while building the
  loading state dict) asserts that every parameter has a "step"; its state is first created
  as `init_state_fn` does, with a step of 0 (overwritten by the load);
- its `load_state_dict` gives every parameter the same "step" tensor, which torch's Adam then
  increments once per parameter per step (wrong bias correction): each gets its own copy; and
  its `_set_main_param_and_optimizer_states` copies every state key from the loaded tensors,
  which have no "step" in that format: while loading, that method of the instance supplies the
  step `load_state_dict` has just set (`_keep_step`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_async_rl.compat import megatron_fixes
from megatron_async_rl.models import torch_fsdp2
from megatron_async_rl.roles.lr_schedule import load_scheduler_state

logger = logging.getLogger(__name__)

SHARDING = "fully_reshardable"
SCHEDULER = "opt_param_scheduler"  # Megatron-LM's key for it
# Common-part keys only train ranks hold: not a mismatch for the save's consistency check.
_TRAIN_ONLY = ("optimizer", SCHEDULER)


def _optimizers(role) -> list:
    return list(getattr(role.optimizer, "chained_optimizers", None) or [role.optimizer])


def _metadata(role) -> dict:
    return {"dp_cp_group": role.pgc.dp_cp, "distrib_optim_sharding_type": SHARDING}


def _model_keys(role) -> list[str]:
    """Each model chunk's key in the checkpoint, as Megatron-LM names them: "model" for one
    chunk, "model0", "model1", ... with virtual pipeline stages (the tensors inside carry global
    layer offsets, so a checkpoint loads whatever the chunking)."""
    return ["model"] if len(role.chunks) == 1 else [f"model{v}" for v in range(len(role.chunks))]


def _sharded(role, loading: bool) -> dict:
    metadata = _metadata(role)
    fsdp2 = torch_fsdp2.sharded(role.chunks)  # --use-torch-fsdp2 (tensor parallelism 1)
    if fsdp2:
        torch_fsdp2.check_even_shards(role.chunks, role.role)
    with megatron_fixes.fsdp2_row_shards() if fsdp2 else contextlib.nullcontext():
        model = {
            key: chunk.sharded_state_dict(metadata=metadata)
            for key, chunk in zip(_model_keys(role), role.chunks, strict=True)
        }
    out = dict(model)
    if role.optimizer is not None:
        if loading:
            _create_optimizer_state(role)
        with _without_forced_full_gc():
            out["optimizer"] = role.optimizer.sharded_state_dict(
                model["model"] if len(model) == 1 else model, is_loading=loading,
                metadata=metadata,
            )  # fmt: skip
    if role.lr_scheduler is not None and not loading:
        out[SCHEDULER] = role.lr_scheduler.state_dict()
    return out


@contextlib.contextmanager
def _without_forced_full_gc():
    """The distributed optimizer's `sharded_state_dict` runs two full `gc.collect()`s around its
    gather ("prevent memory leaks with GC disabled", for Megatron-LM's --manual-gc). With the
    collector enabled they free nothing it would not, and they were 0.27 s of a 0.35 s snapshot
    (`benchmarks/checkpoint.py --profile-stall`, CPU): skipped then, kept when it is disabled."""
    from megatron.core.optimizer import distrib_optimizer

    if not gc.isenabled() or distrib_optimizer.gc is not gc:
        yield
        return
    distrib_optimizer.gc = SimpleNamespace(collect=lambda generation=2: 0)
    try:
        yield
    finally:
        distrib_optimizer.gc = gc


def _create_optimizer_state(role) -> None:
    for opt in _optimizers(role):
        inner = opt.optimizer
        if opt.init_state_fn is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))


def save_train_state(train, path: Path, writer: AsyncWriter | None = None) -> None:
    """Write the train role's model, optimizer and lr schedule under `path` (collective over
    the world; `train` is None on ranks without the role). With `writer`, only the snapshot
    happens here: a forked process writes the files (`AsyncWriter.finish` says when every rank
    is done)."""
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    state = _sharded(train, loading=False) if train is not None else {}
    if train is not None:  # ranks without the role have nothing to write
        start_write_queue()
    try:
        request = dist_checkpointing.save(
            state, str(path), async_sharded_save=writer is not None,
            preprocess_common_before_consistancy_check=lambda common: {
                k: v for k, v in common.items() if k not in _TRAIN_ONLY
            },
            **_async_strategy_kwargs(dist_checkpointing.save),
        )  # fmt: skip
        if writer is not None:
            writer.queue.schedule_async_request(request)
    except BaseException:
        stop_write_queue()
        raise


def _async_strategy_kwargs(save) -> dict:
    """The asynchronous save's strategy, chosen explicitly where megatron-core has the choice
    (0.19 and later: `async_strategy`, whose default "nvrx" needs nvidia-resiliency-ext): "mcore",
    whose requests `AsyncWriter`'s queue (megatron-core's own `AsyncCallsQueue`) runs, as 0.16
    does without the choice. 0.19 logs once that this strategy is deprecated there."""
    import inspect

    if "async_strategy" not in inspect.signature(save).parameters:
        return {}
    return {"async_strategy": "mcore"}


class AsyncWriter:
    """megatron-core's queue of background checkpoint writes (`AsyncCallsQueue`), one at a time.

    The write runs in a process forked at `schedule` time: host tensors are its snapshot (the
    fork's copy-on-write pages; device tensors are first copied to host memory by
    dist_checkpointing's preload), so training may change the weights at once. `finish` is
    collective over the world (an all-reduce says whether every rank's write ended) and runs
    dist_checkpointing's finalization (its metadata file) once all are done."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)

    @property
    def busy(self) -> bool:
        return self.queue.get_num_unfinalized_calls() > 0

    def finish(self, blocking: bool, group=None, timeout_s: float = 600.0) -> bool:
        """True once no write is left (collective over the world; `group`, the world's gloo
        group for the timeout's vote). `blocking` waits for it, at most `timeout_s`: a writer
        that died or hangs (megatron-core would wait for it forever) ends the run with an
        error on every rank, and resume uses the previous checkpoint."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.queue.maybe_finalize_async_calls(blocking=False)  # the same answer everywhere
            if not self.busy or not blocking:
                return not self.busy
            late = torch.tensor([int(time.monotonic() > deadline)])
            dist.all_reduce(late, op=dist.ReduceOp.MAX, group=group)
            if late.item():
                raise RuntimeError(
                    f"checkpoint: the background write did not finish within {timeout_s:.0f} s "
                    "(scheduler.stage_timeout_s) on every rank: a writer process died or hangs"
                )
            time.sleep(0.1)

    def close(self) -> None:
        self.queue.close(abort=True)


def start_write_queue() -> None:
    """megatron-core's writer collects its results through a queue of a
    `multiprocessing.Manager` server, started (spawned: it imports this program again, seconds)
    at the first save and kept for the rest of the process; a rank killed with SIGKILL left it
    behind, an orphan. Started here instead, once, with a server that dies with this process
    (Linux's parent-death signal), so every later save reuses it."""
    from multiprocessing import get_context
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    # A save-and-exit signal to the process group while the server is being spawned (seconds:
    # it imports this program) kills it before its initializer ignores that signal (the
    # e2e preemption test, once: EOFError, the save failed). torchrun and SLURM send it once:
    # a second server is not hit. (A signal mask does not help: spawn's child starts with
    # none blocked.)
    for attempt in range(3):
        manager = SyncManager(ctx=get_context("spawn"))
        try:
            manager.start(initializer=_die_with_parent, initargs=(os.getpid(),))
            break
        except (EOFError, ConnectionError) as exc:
            logger.warning("checkpoint writer server died while starting (%r, a signal to the "
                           "process group?): starting another", exc)  # fmt: skip
            if attempt == 2:
                raise
    filesystem_async._results_queue = manager.Queue()
    filesystem_async._results_queue._manager = manager  # for `stop_write_queue`


def _die_with_parent(parent: int) -> None:
    """In the Manager server: SIGKILL when the process that started it ends, and nothing else.
    torchrun signals a rank's whole process group on SIGTERM: the server ignores the
    save-and-exit signals, or the rank's save on that signal would find it dead."""
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: `stop_write_queue` at the end is all there is
        return
    if os.getppid() != parent:  # it ended before the line above
        os._exit(0)


def stop_write_queue() -> None:
    """Stop megatron-core's writer results queue and its Manager server (at the end of the
    run, `CheckpointManager.close`; `start_write_queue`)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager = getattr(filesystem_async._results_queue, "_manager", None)
    if manager is not None:
        filesystem_async._results_queue = None
        manager.shutdown()


def load_train_state(train, path: Path) -> None:
    """Load the train role's model, optimizer and lr schedule from `path` into `train`
    (collective over the world, whatever layout saved it)."""
    from megatron.core import dist_checkpointing

    state = _sharded(train, loading=True) if train is not None else {}
    loaded = dist_checkpointing.load(state, str(path))
    if train is None:
        return
    for key, chunk in zip(_model_keys(train), train.chunks, strict=True):
        chunk.load_state_dict(torch_fsdp2.shard_loaded_state(chunk, loaded[key]))
    if train.optimizer is not None:
        distributed = [o for o in _optimizers(train) if hasattr(o, "model_param_group_index_map")]
        for opt in distributed:
            opt._set_main_param_and_optimizer_states = _keep_step(opt)
        try:
            train.optimizer.load_state_dict(loaded["optimizer"])
        finally:
            for opt in distributed:
                del opt._set_main_param_and_optimizer_states  # the class's method again
        for opt in _optimizers(train):
            for param_state in opt.optimizer.state.values():
                if "step" in param_state:  # one tensor per parameter (see the module doc)
                    param_state["step"] = param_state["step"].clone()
            torch_fsdp2.shard_optimizer_state(opt.optimizer)
    if train.lr_scheduler is not None:
        # After the optimizer's load, which replaced its param groups with the checkpoint's.
        load_scheduler_state(train.lr_scheduler, loaded.get(SCHEDULER), train.args, str(path))


def _keep_step(opt):
    """`opt._set_main_param_and_optimizer_states` that keeps the "step" already in the state
    when the loaded tensors have none (see the module doc)."""
    original = type(opt)._set_main_param_and_optimizer_states

    def setter(model_param, tensors):
        if "step" not in tensors:
            group, order = opt.model_param_group_index_map[model_param]
            main = opt.optimizer.param_groups[group]["params"][order]
            step = opt.optimizer.state[main].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(opt, model_param, tensors)

    return setter
