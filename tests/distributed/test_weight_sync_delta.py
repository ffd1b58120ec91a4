"""Delta weight sync over the broadcast transport, on three gloo ranks (one sender, two receivers).

Contracts (`executor.run_plan` with `DeltaBases`, `weight_sync.delta`; bf16 messages, a real
plan of the small dense model; nothing is faked):
- the first sync is whole (nothing held), and every later one sends deltas: a small update
  (about 1% of the elements) crosses in a few percent of the bytes, and every receiver's staged
  tensors equal the sender's bit for bit, version after version;
- a corrupted delta (its encoded bytes flipped on one receiver) fails that receiver's sync,
  counted (`delta_failures`); the same version sent again is whole for that sender, and every
  receiver again holds the sender's exact weights; deltas resume the version after;
- a receiver that lost its bases (a restarted or new rank: a new `DeltaBases`) makes its
  sender's next sync whole, for every receiver of the group;
- a version never synced (the trainer stepped twice between syncs) needs nothing: the next delta
  is taken against the version every rank holds, and is exact;
- every `full_every`-th version is whole;
- a sender that resumed (a new process: a new `DeltaBases`) sends its next sync whole;
- without bases the wire carries whole messages as before (no codec, no delta metrics).
"""

from __future__ import annotations

import torch

from tests.harness.ranks import spawn
from tests.harness.weight_sync import DIMS


def _worker(rank, world_size, tmp_dir):
    import torch.distributed as dist

    from megatron_async_rl.models.names import hf_to_megatron
    from megatron_async_rl.models.shards import stage_state_dict
    from megatron_async_rl.weight_sync import buffers, executor, sinks
    from megatron_async_rl.weight_sync.delta_wire import DeltaBases
    from megatron_async_rl.weight_sync.plan import TrainLayout, build_plan

    plan = build_plan(TrainLayout(offset=0, tp=1, pp=1, dp=1), DIMS, "bfloat16", 64 << 10, 16 << 10)
    group = dist.new_group([0, 1, 2])
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in plan.hf_shapes}
    pool = buffers.BufferPool()
    pool.delta_bases = DeltaBases(full_every=5)
    log = []

    def sync(version, tamper=None):
        local = None
        if rank == 0:
            full = hf_to_megatron(hf, DIMS)
            local = stage_state_dict(full, DIMS, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        counter = buffers.MemoryCounter()
        sink = None
        if rank > 0:
            sink = sinks.StagingSink(plan, counter, version, plan.consume_bytes, pool)
        stats = executor.run_plan(
            plan, rank, version, {0: group}, local=local, tp_groups={}, sink=sink,
            counter=counter, pool=pool, transport="broadcast", tamper=tamper,
            bases=pool.delta_bases,
        )  # fmt: skip
        exact = None
        if sink is not None and stats.error is None:
            exact = all(torch.equal(sink.weights[n], t) for n, t in hf.items())
        log.append({
            "version": version, "delta": stats.delta_senders, "full": stats.full_senders,
            "fraction": stats.wire_bytes / max(stats.full_bytes, 1),
            "failures": stats.delta_failures, "error": str(stats.error or ""), "exact": exact,
            "base_MB": counter.peak.get("delta_base", 0) / 2**20,
        })  # fmt: skip

    def update():  # about 1% of the elements move by one bf16 step
        for t in hf.values():
            flat = t.view(-1)
            picked = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
            flat[picked] = (flat[picked].float() * (1 + 2**-6)).to(t.dtype)

    def flip(body, version, seq):  # the encoded bytes of one message, on receiver 2
        if rank == 2 and seq == 1:
            body[:64] ^= 0x5A

    for version in (1, 2, 3):
        sync(version)
        update()
    sync(4, tamper=flip)  # receiver 2 fails; everyone learns it in the jobs (`_agree`): again
    sync(4)
    update()
    sync(5)
    update()
    if rank == 1:
        pool.delta_bases = DeltaBases(full_every=5)  # receiver 1 restarted
    sync(6)
    update()
    sync(7)
    update()  # version 8 is never synced: the trainer moved on twice before the next sync
    update()
    for version in (9, 10, 11, 12):
        sync(version)
        update()
    if rank == 0:
        pool.delta_bases = DeltaBases(full_every=5)  # the trainer resumed from a checkpoint
    sync(13)
    update()
    sync(14)
    update()
    plain = buffers.BufferPool()
    counter = buffers.MemoryCounter()
    sink = sinks.StagingSink(plan, counter, 15, plan.consume_bytes, plain) if rank else None
    local = None
    if rank == 0:
        full = hf_to_megatron(hf, DIMS)
        local = stage_state_dict(full, DIMS, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    stats = executor.run_plan(plan, rank, 15, {0: group}, local=local, tp_groups={}, sink=sink,
                              counter=counter, pool=plain, transport="broadcast")  # fmt: skip
    plain_exact = sink is None or all(torch.equal(sink.weights[n], t) for n, t in hf.items())
    return log, (stats.full_bytes, stats.delta_senders, stats.full_senders, plain_exact)


def test_deltas_are_exact_and_every_fallback_is_whole(tmp_path):
    results = spawn(_worker, 3, tmp_path)
    logs = [log for log, _ in results]
    # v1 whole (nothing held); v2, v3 deltas; v4 a delta receiver 2 cannot take, then v4 again,
    # whole (receiver 2 dropped its bases); v5 delta; v6 whole (receiver 1 restarted); v7-v10
    # v7 delta; v8 skipped: v9 a delta against v7, which every rank holds; v10, v11 deltas; v12
    # whole (full_every 5: four deltas in a row before it); v13 whole (the sender resumed: a new
    # process holds nothing); v14 delta
    expected = ["full", "delta", "delta", "delta", "full", "delta", "full", "delta", "delta",
                "delta", "delta", "full", "full", "delta"]  # fmt: skip
    for rank, log in enumerate(logs):
        assert [row["version"] for row in log] == [1, 2, 3, 4, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14]
        assert ["delta" if row["delta"] else "full" for row in log] == expected, (rank, log)
        for row in log:
            if row["delta"]:
                assert row["fraction"] < 0.25, (rank, row)
            else:  # the whole message, and its header
                assert 1.0 < row["fraction"] < 1.01, (rank, row)
            assert row["base_MB"] > 0 or row["error"], (rank, row)  # a failed sync drops them
        failed = [row for row in log if row["error"]]
        if rank == 2:
            assert failed == [log[3]] and log[3]["failures"] == 1, log
            assert "did not decode" in log[3]["error"] or "checksum" in log[3]["error"]
        else:
            assert not failed, (rank, failed)
        if rank:  # every sync that ended cleanly staged the sender's exact weights
            assert all(row["exact"] for row in log if not row["error"]), (rank, log)
    for full_bytes, deltas, fulls, exact in (plain for _, plain in results):
        assert (full_bytes, deltas, fulls) == (0, 0, 0) and exact
