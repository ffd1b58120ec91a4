"""Where received weights go: straight into an engine, or into host staging first.

Owned here: `EngineSink` (streams each verified message into an engine through its own
weight-update API, one `update_weights` call per message of whole tensors plus one per tensor
that was split over messages), `StagingSink` / `StagedWeights` (whole HF tensors in host memory,
for the logp role and for loading later while generation keeps running) and `load_into_engine`
(a staged dict into an engine in chunks of at most `consume_bytes`). Called by
`weight_sync.executor` (sinks) and `weight_sync.broadcast` (the public entry points).

Version stamps: SGLang stamps the version of every `update_weights` call on the tokens it
generates next, so every call but the last carries the engine's current label and the last one
carries `v<version>`: an engine whose sync fails half-way still reports the previous version
(its weights, though, may be partly new; a failure before the first load leaves them intact).
"""

from __future__ import annotations

import logging

import torch

from megatron_async_rl.weight_sync import buffers

logger = logging.getLogger(__name__)


def engine_version_label(version: int) -> str:
    return f"v{version}"


class StagedWeights(dict):
    """HF name -> whole tensor, as received for version `version` (host memory)."""

    def __init__(self, version: int, consume_bytes: int):
        super().__init__()
        self.version, self.consume_bytes = version, consume_bytes


class StagingSink:
    """Copies every received tensor into a `StagedWeights` (the receive buffers are reused)."""

    borrows_buffers = False

    def __init__(self, dtype: torch.dtype, counter, version: int, consume_bytes: int):
        self.assembler = buffers.Assembler(dtype, counter)
        self.counter = counter
        self.weights = StagedWeights(version, consume_bytes)

    def add(self, message, pieces, sender: int, seq: int, last: bool) -> None:
        for piece, values in pieces:
            whole = self.assembler.add(piece, values)
            if whole is not None and piece.is_whole:
                whole = whole.clone()
                self.counter.add("staging", whole.numel() * whole.element_size())
            if whole is not None:
                self.weights[piece.hf_name] = whole


class EngineSink:
    """Loads each verified message into `engine` (between begin/end weight update)."""

    #: Handing a CPU tensor to the engine's process moves its storage into shared memory.
    borrows_buffers = True

    def __init__(self, engine, version: int, rank: int, counter, dtype, in_place: bool = False):
        self.engine, self.version, self.rank, self.in_place = engine, version, rank, in_place
        self.assembler = buffers.Assembler(dtype, counter)
        self.old_label = ""
        self.opened = False

    def begin(self) -> None:
        if self.in_place:
            self.engine.pause("in_place")
        self.old_label = self.engine.weight_version()
        self.engine.begin_weight_update()
        self.opened = True

    def finish(self) -> None:
        try:
            if self.opened:
                self.engine.end_weight_update()
        finally:
            if self.in_place:
                self.engine.resume()

    def add(self, message, pieces, sender: int, seq: int, last: bool) -> None:
        whole, split = [], []
        for piece, values in pieces:
            tensor = self.assembler.add(piece, values)
            if tensor is not None:
                (whole if piece.is_whole else split).append((piece, tensor))
        calls = ([whole] if whole else []) + [[item] for item in split]
        if last and not calls:
            calls = [[]]
        for i, call in enumerate(calls):
            final = last and i == len(calls) - 1
            named = [(piece.hf_name, tensor) for piece, tensor in call]
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
    engine, tensors: dict, version: int, in_place: bool = False, consume_bytes: int | None = None
) -> None:
    """Load HF-named whole tensors into `engine` in chunks of <= `consume_bytes`; stamp version.

    `consume_bytes` defaults to the one `tensors` was received with (a `StagedWeights`), else
    to `WeightSyncConfig`'s. A tensor larger than a chunk is loaded alone. `in_place`: the engine
    keeps its requests around the load (pause in place -> load -> continue); its prefix cache is
    not flushed here (SGLang cannot flush with requests held): the caller flushes once idle.
    """
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
    if in_place:
        engine.pause("in_place")
    try:
        old_label = engine.weight_version()
        engine.begin_weight_update()
        try:
            for i, chunk in enumerate(chunks):
                final = i == len(chunks) - 1
                engine.update_weights(
                    chunk,
                    version=engine_version_label(version) if final else old_label,
                    flush_cache=final and not in_place,
                )
        finally:
            engine.end_weight_update()
    finally:
        if in_place:
            engine.resume()
