"""Weight-sync throughput and memory on CPU: a raw gloo broadcast vs our pipeline, side by side.

    .venv/bin/python benchmarks/weight_sync.py [--hidden-size 1024 --num-layers 4]
        [--num-generate 1] [--train-tp 1] [--repeats 3]
    .venv/bin/python benchmarks/weight_sync.py --rl-update ...
        (benchmarks/weight_sync_rl_update.py: deltas of real RL updates vs whole messages vs a
        raw broadcast, on one and two hosts)

Spawns gloo ranks on CPU (`tests/harness/ranks.py`): `--train-tp` Megatron train ranks
holding a tiny-architecture Llama made large (~250 MB fp32 by default, `models/tiny.py`) and
`--num-generate` generate ranks, each hosting a real SGLang engine. In one run it measures
(1) a raw gloo broadcast of the model's byte count from the train role's first rank to the
generate ranks (whole, and in 16 MB chunks), (2) our weight-sync pipeline end to end (gather ->
send -> load into every engine; time to the slowest receiver) at its default configuration (on
one host: the shared-memory transport), and the same with `transport: broadcast` (whole
messages over gloo), (3) the pipeline at produce = consume bucket sizes of 1, 4, 16, 64 and
256 MB. Before the first sync the trainer's weights are perturbed, so that the engines'
read-back (`get_weights_by_name`, SGLang's own read path) being byte-identical to the trainer's
gathered HF tensors is not vacuous.

Every rank syncs as a job does: with one `BufferPool` per configuration, kept from one sync to
the next (each configuration syncs once before the measured repeats: a job's steady state); the
raw broadcast likewise reuses one buffer, written once. Peak extra memory of a rank is what its
pool held before the sync plus the largest growth during it (sampled every 5 ms) of its private
memory (`RssAnon` of the rank, and on a generate rank of its engine's processes too) and of the
machine's shared memory (`/dev/shm`, counted once however many processes map it, split evenly
over the generate ranks, the only ones that allocate it); the table also shows the pipeline's
own buffer accounting (`weight_sync/*_peak_MB`, summed over kinds). The bound is
`WeightSyncConfig`'s: 2 produce buffers on a sender, 2 consume buffers on a receiver, plus one
whole HF tensor when the largest is bigger than a message.

Pipeline under test: `weight_sync.broadcast.sync_weights`, at its default configuration and at
each bucket size of the sweep. Last line:
`RESULT ratio_vs_raw=<float> bit_identical=<true|false> peak_over_bound=<float>` where
ratio_vs_raw = pipeline throughput at the default configuration / raw broadcast throughput (the
faster of one N-byte broadcast and N bytes in 16 MB broadcasts), per repeat, median over repeats
(measurements are interleaved, so a repeat's raw and pipeline share the load; target >= 0.7),
bit_identical
says every engine tensor read back equals the trainer's, and peak_over_bound is the default
configuration's measured peak / bound, the worse of sender and receiver (the sweep's are in the
table).
A benchmark, not a test: 2 shared cores are noisy; read ratios, not absolute seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUCKETS_MB = (1, 4, 16, 64, 256)
RAW_CHUNKS = (None, 16 * (1 << 20))
MB = 1 << 20


# -- the pipeline under test: the only code that knows its API ----------------------------------


def _sync(ctx: dict, bucket_mb: int | None) -> dict:
    """One end-to-end weight sync (collective over all ranks); this rank's metrics.

    `bucket_mb`: produce and consume bucket size; None for the default configuration,
    "broadcast" for it with `transport: broadcast` (whole messages over gloo even between ranks
    of one host). Each configuration has its own `BufferPool`, as a job running it would.
    """
    from megatron_async_rl.weight_sync.broadcast import sync_weights
    from megatron_async_rl.weight_sync.buffers import BufferPool
    from megatron_async_rl.weight_sync.config import WeightSyncConfig

    ctx["version"] += 1
    config = WeightSyncConfig()
    if bucket_mb == "broadcast":
        config = WeightSyncConfig(transport="broadcast")
    elif bucket_mb is not None:
        config = WeightSyncConfig(produce_bucket_mb=bucket_mb, consume_bucket_mb=bucket_mb)
    pool = ctx["pools"].setdefault(bucket_mb, BufferPool())
    ctx["held"] = pool.held_bytes
    return sync_weights(ctx["groups"], ctx["roles"], ctx["engine"], ctx["version"], config, pool)


def _bound_bytes(bucket_mb: int | str | None, largest_tensor: int) -> tuple[int, int]:
    """(sender, receiver) peak extra memory the configuration promises (`WeightSyncConfig`):
    2 produce buffers / 2 consume buffers, plus one whole HF tensor larger than a message."""
    from megatron_async_rl.weight_sync.config import WeightSyncConfig

    if bucket_mb in (None, "broadcast"):
        default = WeightSyncConfig()
        produce, consume = default.produce_bytes, default.consume_bytes
    else:
        produce = consume = bucket_mb * MB
    staged = largest_tensor if largest_tensor > consume else 0
    return 2 * produce + staged, 2 * consume + staged


# -- measurement ---------------------------------------------------------------------------


def _private_bytes(pid: int) -> int:
    """`RssAnon` of a process (0 once it is gone): its own pages, no file or shared ones."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _shared_bytes() -> int:
    """Bytes in use in /dev/shm (torch's shared tensors live there, unlinked but counted)."""
    stat = os.statvfs("/dev/shm")
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


class PeakMemory:
    """Largest growth, while running, of the given processes' private memory (this one's by
    default) plus, if `shared_share` > 0, that fraction of the machine's shared memory."""

    def __init__(self, pids=(), shared_share: float = 0.0):
        self.pids, self.share = [os.getpid(), *pids], shared_share
        self.base = self._now()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _now(self) -> float:
        shared = _shared_bytes() * self.share if self.share else 0.0
        return sum(_private_bytes(pid) for pid in self.pids) + shared

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._now())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())

    @property
    def extra(self) -> int:
        return int(self.peak - self.base)


def _timed(ctx: dict, fn) -> tuple[float, int, float, dict]:
    """Seconds from the first rank's start to the last rank's end of `fn`, this rank's peak
    extra memory during it (with what its buffer pool already held), the MiB of buffers the
    pipeline itself counted, and its stage timings on this rank."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    ctx["held"] = 0
    with PeakMemory(ctx["engine_pids"], ctx["shared_share"]) as memory:
        start = time.perf_counter()
        metrics = fn() or {}
        end = time.perf_counter()
    span = torch.tensor([-start, end], dtype=torch.float64)
    dist.all_reduce(span, op=dist.ReduceOp.MAX)
    counted = sum(v for k, v in metrics.items() if k.endswith("_peak_MB"))
    stages = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith("timing/")}
    return float(span[0] + span[1]), memory.extra + ctx["held"], counted, stages


def _raw_broadcast(ctx: dict, num_bytes: int, chunk_bytes: int | None) -> tuple:
    """`num_bytes` from the train role's first rank to the generate ranks: one broadcast, or
    back-to-back broadcasts of `chunk_bytes`. The buffer is allocated and written once per rank
    and reused, as the pipeline's pooled buffers are (fresh pages would cost it a copy's time)."""
    import torch
    import torch.distributed as dist

    group, src = ctx["raw_group"], 0
    if group is None:  # a train rank that sends nothing: just keep the timing
        return _timed(ctx, lambda: None)
    buf = ctx.get("raw_buffer")
    if buf is None or buf.numel() != num_bytes:
        buf = ctx["raw_buffer"] = torch.empty(num_bytes, dtype=torch.uint8)
        buf.random_(generator=torch.Generator().manual_seed(dist.get_rank()))
    chunks = buf.split(chunk_bytes) if chunk_bytes else [buf]

    def send() -> None:
        for chunk in chunks:
            dist.broadcast(chunk, src=src, group=group)

    return _timed(ctx, send)


def _trainer_checksums(ctx: dict) -> dict | None:
    """{HF name: (shape, crc32 of the bytes)} of the trainer's gathered tensors (train rank 0)."""
    if "train" not in ctx["roles"]:
        return None
    hf = ctx["roles"]["train"].gather_hf_state_dict()
    if hf is None:
        return None
    return {k: (tuple(v.shape), zlib.crc32(v.contiguous().numpy())) for k, v in hf.items()}


def _engine_matches(engine, expected: dict) -> list[str]:
    """Names whose engine read-back differs from the trainer's (padded vocab rows must be 0)."""
    bad = []
    for name, (shape, crc) in expected.items():
        got = engine.get_weights_by_name(name)
        rows = shape[0]
        if tuple(got[:rows].shape) != shape or got[rows:].any():
            bad.append(name)
        elif zlib.crc32(got[:rows].contiguous().numpy()) != crc:
            bad.append(name)
    return bad


# -- ranks ---------------------------------------------------------------------------------


def _worker(rank, world_size, tmp_dir, model_path, train_tp, repeats, num_bytes):
    import torch
    import torch.distributed as dist

    from megatron_async_rl.config.megatron import table
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.engines.sglang.engine import SGLangEngine, SGLangEngineConfig
    from megatron_async_rl.models import hf_checkpoint, hf_config
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole

    args = table.defaults()
    args.update(hf_config.megatron_args_from_hf(hf_checkpoint.read_hf_config(model_path)))
    args.update(tensor_model_parallel_size=train_tp, lr=1e-5)
    par = Parallelism.from_megatron_args(args)
    specs = [
        RoleGroupSpec(["train"], num_ranks=train_tp),
        RoleGroupSpec(["generate"], num_ranks=world_size - train_tp),
    ]
    layout = plan_layout(world_size, specs, {"train": par})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    ctx = {"groups": groups, "roles": {}, "engine": None, "engine_pids": [], "version": 0}
    ctx.update(pools={}, shared_share=0.0, held=0)
    raw_ranks = [0, *range(train_tp, world_size)]  # the train role's first rank + receivers
    raw_group = dist.new_group(raw_ranks, backend="gloo")
    ctx["raw_group"] = raw_group if rank in raw_ranks else None
    if rank < train_tp:
        role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=1)
        role.load_hf_checkpoint(model_path)
        with torch.no_grad():  # the engines start from the checkpoint: make the sync matter
            gen = torch.Generator().manual_seed(100 + rank)
            for param in role.module.parameters():
                param.add_(1e-3 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
        ctx["roles"]["train"] = role
    else:
        config = SGLangEngineConfig(
            model_path=model_path, dtype="float32", max_total_tokens=2048, call_timeout_s=600
        )
        ctx["engine"] = SGLangEngine(config, rank_in_role=rank - train_tp, global_rank=rank)
        ctx["engine_pids"] = [ctx["engine"].host_pid, *ctx["engine"].engine_child_pids]
        ctx["shared_share"] = 1.0 / (world_size - train_tp)
    out = {"rank": rank, "role": "train" if rank < train_tp else "generate"}
    try:
        _raw_broadcast(ctx, num_bytes, None)  # warm the connections and the raw buffer
        buckets = (None, "broadcast", *BUCKETS_MB)
        for bucket in buckets:  # warm-up: first load into the engine, each pool filled once
            _sync(ctx, bucket)
        out["raw"] = {chunk: [] for chunk in RAW_CHUNKS}
        out["pipeline"] = {bucket: [] for bucket in buckets}
        for _ in range(repeats):  # interleaved, so that each repeat shares the machine's load
            for chunk in RAW_CHUNKS:
                out["raw"][chunk].append(_raw_broadcast(ctx, num_bytes, chunk))
            for bucket in buckets:
                out["pipeline"][bucket].append(_timed(ctx, lambda b=bucket: _sync(ctx, b)))
        expected = [_trainer_checksums(ctx)]
        dist.broadcast_object_list(expected, src=0)
        if ctx["engine"] is not None:
            out["mismatched"] = _engine_matches(ctx["engine"], expected[0])
            out["num_checked"] = len(expected[0])
    finally:
        if ctx["engine"] is not None:
            ctx["engine"].shutdown()
    return out


# -- report --------------------------------------------------------------------------------


def _summary(results: list[dict], pick) -> dict:
    """Median seconds over repeats, and the peaks over repeats of RSS growth (senders: train
    ranks; receivers: generate ranks with their engines) and of the pipeline's counted buffers."""
    runs = {r["rank"]: pick(r) for r in results}

    def peak(role: str, index: int) -> float:
        values = (run[index] for r in results if r["role"] == role for run in runs[r["rank"]])
        return max(values, default=0)

    return {
        "s": statistics.median(run[0] for run in runs[0]),  # every rank holds the same span
        "send": peak("train", 1),
        "recv": peak("generate", 1),
        "send_counted_MB": peak("train", 2),
        "recv_counted_MB": peak("generate", 2),
    }


def _model_bytes(model_path: Path) -> tuple[int, int]:
    """(total, largest tensor) bytes of the HF checkpoint."""
    from safetensors import safe_open

    sizes = []
    for path in model_path.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                numel = 1
                for dim in tensor.get_shape():
                    numel *= dim
                sizes.append(numel * {"F32": 4, "BF16": 2, "F16": 2}[tensor.get_dtype()])
    return sum(sizes), max(sizes)


def main() -> None:
    if "--rl-update" in sys.argv[1:]:  # real RL updates: deltas vs whole vs raw, 1 and 2 hosts
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from weight_sync_rl_update import main as rl_update

        rl_update([a for a in sys.argv[1:] if a != "--rl-update"])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-generate", type=int, default=1)
    parser.add_argument("--train-tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from megatron_async_rl.models.tiny import write_tiny_model
    from tests.harness.ranks import spawn

    root = Path(tempfile.mkdtemp(prefix="weight_sync_bench_"))
    model = write_tiny_model(
        root / "model",
        "llama",
        seed=0,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=args.hidden_size // 128,
    )
    num_bytes, largest = _model_bytes(model)
    world = args.train_tp + args.num_generate
    started = time.perf_counter()
    results = spawn(_worker, world, root, str(model), args.train_tp, args.repeats, num_bytes)
    gb = num_bytes / 1e9

    print(f"model {num_bytes / MB:.0f} MiB fp32 (largest tensor {largest / MB:.0f} MiB), "
          f"train TP {args.train_tp}, {args.num_generate} generate rank(s), median of "
          f"{args.repeats}")  # fmt: skip
    print(f"{'':<28}{'s':>8}{'GB/s':>8}{'send MiB':>10}{'recv MiB':>10}{'bound MiB':>11}"
          f"{'peak/bnd':>9}{'counted MiB':>13}")  # fmt: skip
    for chunk in RAW_CHUNKS:
        raw = _summary(results, lambda r, c=chunk: r["raw"][c])
        label = "raw broadcast" + (", whole" if chunk is None else f", {chunk // MB} MB chunks")
        print(f"{label:<28}{raw['s']:>8.3f}{gb / raw['s']:>8.3f}"
              f"{raw['send'] / MB:>10.0f}{raw['recv'] / MB:>10.0f}")  # fmt: skip
    rows = {}
    for bucket in results[0]["pipeline"]:
        row = _summary(results, lambda r, b=bucket: r["pipeline"][b])
        bound = _bound_bytes(bucket, largest)
        row["over"] = max(row["send"] / bound[0], row["recv"] / bound[1])
        rows[bucket] = row
        label = {None: "pipeline, default config", "broadcast": "  same, broadcast transport"}
        label = label.get(bucket, f"pipeline, {bucket} MB buckets")
        print(f"{label:<28}{row['s']:>8.3f}{gb / row['s']:>8.3f}{row['send'] / MB:>10.0f}"
              f"{row['recv'] / MB:>10.0f}{bound[0] / MB:>5.0f}/{bound[1] / MB:<5.0f}"
              f"{row['over']:>9.2f}{row['send_counted_MB']:>6.0f}/"
              f"{row['recv_counted_MB']:<6.0f}")  # fmt: skip
    print("send/recv MiB: peak extra memory (pool held + growth of private memory, receiver's "
          "with its engine's processes, and of /dev/shm); bound: sender/receiver; counted: the "
          "pipeline's own buffer accounting")  # fmt: skip
    mismatched = sorted({name for r in results for name in r.get("mismatched", [])})
    checked = sum(r.get("num_checked", 0) for r in results)
    print(f"engine read-back vs trainer: {checked} tensors checked, {len(mismatched)} differ "
          f"{mismatched[:8]}")  # fmt: skip
    print(f"wall {time.perf_counter() - started:.0f} s; files in {root}")
    # Per repeat: the faster raw variant over the default pipeline, then the median.
    ratios = [
        min(r["raw"][c][i][0] for c in RAW_CHUNKS) / r["pipeline"][None][i][0]
        for r in results[:1]
        for i in range(args.repeats)
    ]
    ratio = statistics.median(ratios)  # seconds ratio = throughput ratio: the same bytes move
    identical = "true" if checked and not mismatched else "false"
    for role in ("train", "generate"):  # where the default configuration's time goes
        stages = [run[3] for r in results if r["role"] == role for run in r["pipeline"][None]]
        names = sorted({k for stage in stages for k in stage})
        medians = {k: statistics.median(stage.get(k, 0.0) for stage in stages) for k in names}
        print(f"default config, {role} ranks (median s): "
              + " ".join(f"{k}={v:.3f}" for k, v in medians.items()))  # fmt: skip
    print(f"ratio per repeat: {' '.join(f'{x:.3f}' for x in ratios)}")
    print(
        f"RESULT ratio_vs_raw={ratio:.3f} bit_identical={identical} "
        f"peak_over_bound={rows[None]['over']:.3f}"
    )


if __name__ == "__main__":
    main()
