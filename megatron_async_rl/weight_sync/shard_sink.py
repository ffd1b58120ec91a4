"""Received weights straight into a Megatron role's parameters (the logp role's sink).

Owned here: `ShardSink`. Called by `weight_sync.broadcast.sync_weights` on a rank that holds
the logp role (and no engine). Review finding 9: the logp rank used to stage the whole model
(every HF tensor, in host shared memory) and then convert all of it (`hf_to_megatron`) to
copy out its own slices, every step. This sink keeps only what its rank holds:
- a piece of an HF tensor no parameter of this rank comes from (another pipeline stage's
  layers, another expert-parallel rank's experts) is dropped as it arrives;
- the pieces it needs go into one buffer per HF tensor, where they arrive (the rank's GPU under
  the device bridge: nothing goes through host memory), until every HF tensor a parameter
  comes from is complete; then the rank's slice is cut from them (`shards.build_shard`: of
  a TP-split parameter only its rows or columns, no whole-parameter copy) and copied into the
  parameter, and buffers no other pending parameter needs are freed.
Peak staging (`weight_sync/staging_peak_MB`) is the HF tensors of the parameters in flight, not
the model. The parameters are written while the sync runs: a failed attempt leaves them mixed,
and the retry (or the run's end, after `max_attempts`) rewrites or abandons them; the logp
role does not compute during a sync (it is a collective on its main thread).
"""

from __future__ import annotations

import math

import torch

from megatron_async_rl.models.dims import ModelDims, hf_shape
from megatron_async_rl.models.names import hf_names_for
from megatron_async_rl.models.shards import build_shard, rank_state_dict, stage_entries


class ShardSink:
    """Copies the pieces `chunks`' rank needs into its parameters (see the module doc)."""

    borrows_buffers = False

    def __init__(self, chunks, dims: ModelDims, ranks: dict, counter, dtype, rank: int):
        """`chunks`: the rank's model chunks (a list, or one module); `ranks`: their place in
        the grid (`weights.stage_ranks`); `rank`: the global rank (named in errors)."""
        self.dims, self.counter, self.dtype, self.rank = dims, counter, dtype, rank
        own = rank_state_dict(chunks)
        entries = stage_entries(dims, **ranks)
        expected = {e.local for e in entries}
        missing, unexpected = sorted(own.keys() - expected), sorted(expected - own.keys())
        if missing or unexpected:
            raise ValueError(
                f"weight sync into the logp role on global rank {self.rank}: its "
                f"parameters {missing[:6]} have no source and sources {unexpected[:6]} have no "
                "parameter (the logp and train roles must build the same model)"
            )
        self.params = own
        self.waiting = {e: set(hf_names_for(e.source, dims)) for e in entries}
        self.users: dict[str, list] = {}
        for entry, sources in self.waiting.items():
            for hf in sources:
                self.users.setdefault(hf, []).append(entry)
        self.left = {hf: math.prod(hf_shape(hf, dims)) for hf in self.users}
        self.buffers: dict[str, torch.Tensor] = {}
        self.counted: set[str] = set()
        self.loaded = 0

    def add(self, message, pieces, sender: int, seq: int, last: bool) -> None:
        for piece, values in pieces:
            if piece.hf_name not in self.users:
                continue  # no parameter of this rank comes from it
            hf = piece.hf_name
            if piece.is_whole:  # used where it lies; copied only if a pending parameter needs it
                self.buffers[hf], self.left[hf] = values.view(piece.shape), 0
                self._complete(hf)
                if hf in self.buffers:
                    self._keep(hf, self.buffers[hf].clone())
                continue
            if hf not in self.buffers:
                self._keep(hf, torch.empty(piece.shape, dtype=self.dtype, device=values.device))
            self.buffers[hf].view(-1)[piece.start : piece.stop].copy_(values)
            self.left[hf] -= piece.numel
            if self.left[hf] == 0:
                self._complete(hf)

    def _keep(self, hf: str, buf: torch.Tensor) -> None:
        self.buffers[hf] = buf
        self.counted.add(hf)
        self.counter.add("staging", buf.numel() * buf.element_size())

    @torch.no_grad()
    def _complete(self, hf: str) -> None:
        for entry in self.users[hf]:
            sources = self.waiting[entry]
            sources.discard(hf)
            if sources:
                continue
            shard = build_shard(entry, self.dims, self.buffers.__getitem__, self._range)
            target = self.params[entry.local]
            if shard.shape != target.shape:
                raise RuntimeError(
                    f"weight sync into the logp role on global rank {self.rank}: "
                    f"parameter {entry.local} has shape {tuple(target.shape)} but the train "
                    f"role sends {tuple(shard.shape)}"
                )
            target.copy_(shard)
            self.loaded += 1
            for source in hf_names_for(entry.source, self.dims):
                if all(not self.waiting[e] for e in self.users[source]):
                    self._free(source)

    def _range(self, hf: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.buffers[hf].narrow(dim, start, stop - start)

    def _free(self, hf: str) -> None:
        buf = self.buffers.pop(hf, None)
        if buf is not None and hf in self.counted:
            self.counted.discard(hf)
            self.counter.sub("staging", buf.numel() * buf.element_size())

    def finish(self, complete: bool) -> str | None:
        """Free what is left; after a complete run, the error if a parameter was not written."""
        pending = sorted(e.local for e, sources in self.waiting.items() if sources)
        for hf in list(self.buffers):
            self._free(hf)
        if complete and pending:
            return (
                f"weight sync into the logp role on global rank {self.rank}: the sync "
                f"ended with {len(pending)} parameter(s) never written: {pending[:6]}"
            )
        return None
