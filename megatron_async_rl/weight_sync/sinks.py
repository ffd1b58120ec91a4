"""Where received weights go: straight into an engine, or into host staging first.

Owned here: `EngineSink` (streams each verified message into an engine through its own
weight-update API, one `update_weights` call per message of whole tensors plus one per tensor
that was split over messages), `StagingSink` / `StagedWeights` (whole HF tensors in shared
memory, for an engine host that loads later while generation keeps running, or a rank with
both an engine and the logp role), `WarmSink` (the start-up reshard that keeps nothing) and
`load_into_engine` (a staged dict into an engine in chunks of at most `consume_bytes`). Called
by `weight_sync.executor` (sinks) and `weight_sync.broadcast` (the public entry points); the
logp role's sink is `weight_sync.shard_sink`.

Version stamps: SGLang stamps the version of every `update_weights` call on the tokens it
generates next, so every call but the last carries the engine's current label and the last one
carries `v<version>`: an engine whose sync fails half-way still reports the previous version.
Its weights, though, are then partly new: the session is ended incomplete and the engine
refuses to generate (`EngineTornError`) until a later update completes (`sync_weights` sends
the version again first: `WeightSyncConfig.max_attempts`). A failure before the first load
leaves the weights intact and the engine serving.
"""

from __future__ import annotations

import logging
import math

import torch

from megatron_async_rl.engines.protocol import ManagedEngine
from megatron_async_rl.weight_sync import buffers

logger = logging.getLogger(__name__)


def engine_version_label(version: int) -> str:
    return f"v{version}"


class StagedWeights(dict):
    """HF name -> whole tensor, as received for version `version` (host memory).

    Staged by a `StagingSink`, the tensors are views of one shared-memory arena: loading them
    into an engine hands over one handle. With a `BufferPool`, the arena is reused by the next
    sync into the same pool: load (or copy) them before that.
    """

    def __init__(self, version: int, consume_bytes: int):
        super().__init__()
        self.version, self.consume_bytes = version, consume_bytes


class StagingSink:
    """Copies every received piece straight to its place in one staging arena (shared memory).

    The arena holds every HF tensor of `reshard` (one model: the staging bound), laid out in
    model order; a tensor is in `weights` once all its pieces have arrived.
    """

    #: A failed version loaded nothing: the engine keeps serving the last one.
    recoverable = True
    borrows_buffers = False

    def __init__(self, reshard, counter, version: int, consume_bytes: int, pool=None, pinned=False):
        """`pinned`: the pieces come from a GPU (the device bridge): the pool's arena is
        page-locked for those copies (review finding 9)."""
        dtype = buffers.torch_dtype(reshard.dtype)
        specs = [(name, shape, dtype) for name, shape in reshard.hf_shapes]
        self.views, total = buffers.shared_arena(specs, pool, pinned)
        counter.add("staging", total)
        self.missing = {name: math.prod(shape) for name, shape in reshard.hf_shapes}
        self.weights = StagedWeights(version, consume_bytes)

    def add(self, message, pieces, sender: int, seq: int, last: bool) -> None:
        for piece, values in pieces:
            self.views[piece.hf_name].view(-1)[piece.start : piece.stop].copy_(values)
            self.missing[piece.hf_name] -= piece.numel
            if self.missing[piece.hf_name] == 0:
                self.weights[piece.hf_name] = self.views[piece.hf_name]


class WarmSink:
    """Takes every message as the rank's real sink will and keeps nothing (`broadcast.warm_up`).

    Its buffers come from the rank's pool under the keys the real sink uses: the consume slots
    (shared when `borrows_buffers`, as an `EngineSink`'s), one split buffer per sender and, with
    `staging`, the whole-model arena of an asynchronous engine host (`pinned` as a
    `StagingSink`'s). Held by the pool afterwards, they exist before an engine sizes its memory.
    """

    def __init__(self, reshard, counter, pool, borrows: bool, staging: bool, pinned: bool):
        dtype = buffers.torch_dtype(reshard.dtype)
        self.borrows_buffers = borrows
        self.assembler = buffers.Assembler(dtype, counter, shared=borrows, pool=pool)
        if staging:
            specs = [(name, shape, dtype) for name, shape in reshard.hf_shapes]
            buffers.shared_arena(specs, pool, pinned)

    def add(self, message, pieces, sender: int, seq: int, last: bool) -> None:
        for piece, values in pieces:
            tensor = self.assembler.add(piece, values, key=sender)
            if tensor is not None:
                self.assembler.release(piece, tensor)


class EngineSink:
    """Loads each verified message into `engine` (between begin/end weight update)."""

    #: What it loads crosses to the engine's processes: it must lie in shared memory.
    borrows_buffers = True

    def __init__(
        self, engine, version: int, rank: int, counter, dtype, in_place: bool = False, pool=None
    ):
        self.engine, self.version, self.rank, self.in_place = engine, version, rank, in_place
        self.assembler = buffers.Assembler(dtype, counter, shared=True, pool=pool)
        self.old_label: str | None = None
        """The engine's label before this version, asked for at the first call that keeps it
        (one round trip to the engine, saved where every tensor goes in the last call)."""
        self.opened = False

    @property
    def recoverable(self) -> bool:
        """A version that fails on every attempt can be undone: the engine reloads the last
        complete one (`RestartingEngine.restore_last_version`, which keeps it)."""
        return isinstance(self.engine, ManagedEngine) and self.engine.keeps_weights

    def begin(self) -> None:
        if self.in_place:
            self.engine.pause("in_place")
        self.engine.begin_weight_update()
        self.opened = True

    def finish(self, complete: bool) -> None:
        """Close the engine's session; incomplete after a load, the engine refuses to generate
        (its weights are torn) until a later update completes."""
        try:
            if self.opened:
                self.engine.end_weight_update(complete=complete)
        finally:
            if self.in_place:
                self.engine.resume()

    def add(self, message, pieces, sender: int, seq: int, last: bool) -> None:
        """Load the message's whole tensors in one call; a split tensor as soon as its last
        piece is in (so that one staging buffer per sender suffices). The last call of the last
        message stamps the new version (with nothing left to load, an empty call does)."""
        whole = []
        for piece, values in pieces:
            tensor = self.assembler.add(piece, values, key=sender)
            if tensor is None:
                continue
            if piece.is_whole:
                whole.append((piece, tensor))
            else:
                self._load([(piece, tensor)], sender, seq, final=False)
        if whole or last:
            self._load(whole, sender, seq, final=last)

    def _load(self, call: list, sender: int, seq: int, final: bool) -> None:
        named = [(piece.hf_name, tensor) for piece, tensor in call]
        if not final and self.old_label is None:  # before any call of this version stamps
            self.old_label = self.engine.weight_version()
        try:
            self.engine.update_weights(
                named,
                version=engine_version_label(self.version) if final else self.old_label,
                flush_cache=final and not self.in_place,
            )
        except Exception as exc:
            names = [n for n, _ in named]
            raise RuntimeError(
                f"weight sync v{self.version}: the engine on receiver global rank "
                f"{self.rank} rejected {names[:8]}{' ...' if len(names) > 8 else ''} "
                f"(message {seq} from sender global rank {sender}): {exc}"
            ) from exc
        for piece, tensor in call:
            self.assembler.release(piece, tensor)


def load_into_engine(
    engine, tensors: dict, version: int, pause: str | None = None, consume_bytes: int | None = None
) -> None:
    """Load HF-named whole tensors into `engine` in chunks of <= `consume_bytes`; stamp version.

    `consume_bytes` defaults to the one `tensors` was received with (a `StagedWeights`), else
    to `WeightSyncConfig`'s. A tensor larger than a chunk is loaded alone. `pause`: the engine keeps
    its requests around the load (pause -> load -> continue). `retract` puts them back in the
    queue, so the prefix cache is flushed with the load as without a pause; `in_place` keeps
    their KV, so it is not flushed here (SGLang cannot flush with requests held): the caller
    flushes once idle.
    """
    load_tensors(engine, tensors, engine_version_label(version), pause, consume_bytes)


def load_tensors(
    engine, tensors: dict, label: str, pause: str | None = None, consume_bytes: int | None = None
) -> None:
    """`load_into_engine` with the version's label as the engine shows it (e.g. "v3"); what an
    engine restarted in place reloads its newest complete version with."""
    if consume_bytes is None:
        from megatron_async_rl.weight_sync.config import WeightSyncConfig

        consume_bytes = getattr(tensors, "consume_bytes", WeightSyncConfig().consume_bytes)
    chunks: list[list] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunks[-1] and size + nbytes > consume_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append((name, tensor))
        size += nbytes
    chunks = [_in_shared_memory(chunk) for chunk in chunks]
    if pause is not None:
        engine.pause(pause)
    try:
        # the label the calls before the last keep (none: no round trip to the engine)
        old_label = engine.weight_version() if len(chunks) > 1 else None
        engine.begin_weight_update()
        complete = False
        try:
            for i, chunk in enumerate(chunks):
                final = i == len(chunks) - 1
                engine.update_weights(
                    chunk,
                    version=label if final else old_label,
                    flush_cache=final and pause != "in_place",
                )
            complete = True
        finally:
            engine.end_weight_update(complete=complete)
    finally:
        if pause is not None:
            engine.resume()


def _in_shared_memory(chunk: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """`chunk` as it should cross to an engine's processes: as is if every CPU tensor already
    lies in shared memory (or on a GPU: CUDA IPC), else copied into one shared buffer. Torch
    would otherwise move each CPU storage there on its own, seconds for a few hundred MiB."""
    if all(t.device.type != "cpu" or t.is_shared() for _, t in chunk):
        return chunk
    views, _ = buffers.shared_arena([(name, tuple(t.shape), t.dtype) for name, t in chunk])
    for name, tensor in chunk:
        views[name].copy_(tensor)
    return list(views.items())
