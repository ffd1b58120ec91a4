"""What routing replay adds to the step's sample exchange: bytes per token and seconds per step.

    .venv/bin/python benchmarks/routing_exchange.py [--samples 64] [--tokens 2048]
        [--layers 48] [--topk 8] [--experts 128] [--ranks 4] [--repeats 3]

Spawns `--ranks` gloo ranks on CPU (`tests/harness/ranks.py`); rank 0 is an engine host
holding `--samples` samples of `--tokens` tokens (prompt + response) and every other rank sends
nothing, as in `jobs/exchange.GlooExchange.share_step` (the payload is the real
`exchange._payload` of a `StepWork`, gathered with the same `devices.all_gather_object`).
Each repeat gathers the step once without and once with each sample's routed experts
([tokens - 1, layers, topk] in `moe.routing.compact_dtype`), interleaved, and reports the
pickled payload bytes, the bytes per token, and the median seconds of the gather, side by side
(defaults: a Qwen3-30B-A3B-like model, 48 MoE layers of 128 experts, top-8). A benchmark, not
a test: 2 shared cores are noisy; read the ratio.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _step(args, routing: bool):
    from megatron_async_rl.moe.routing import compact_dtype
    from megatron_async_rl.roles.work import StepWork
    from megatron_async_rl.rollout.generation import Sample

    g = torch.Generator().manual_seed(0)
    prompt = args.tokens // 4
    samples = []
    for i in range(args.samples):
        experts = None
        if routing:
            experts = torch.randint(0, args.experts, (args.tokens - 1, args.layers, args.topk),
                                    generator=g).to(compact_dtype(args.experts))  # fmt: skip
        samples.append(Sample(
            uid=f"u{i // 8}", prompt_index=i // 8, sample_index=i % 8,
            prompt_ids=torch.randint(0, 150000, (prompt,), generator=g).tolist(),
            response_ids=torch.randint(0, 150000, (args.tokens - prompt,), generator=g).tolist(),
            response_logprobs=(-torch.rand(args.tokens - prompt, generator=g)).tolist(),
            token_versions=["v3"] * (args.tokens - prompt), finish_reason="stop", answer="42",
            routed_experts=experts,
        ))  # fmt: skip
    return StepWork(step=3, samples=samples)


def _worker(rank, world_size, tmp_dir, args):
    import torch.distributed as dist

    from megatron_async_rl.distributed import devices
    from megatron_async_rl.jobs.exchange import _payload

    group = dist.new_group(list(range(world_size)))
    steps = {kind: _step(args, kind == "routing") if rank == 0 else None
             for kind in ("plain", "routing")}  # fmt: skip
    seconds = {kind: [] for kind in steps}
    for _ in range(args.repeats):
        for kind, work in steps.items():
            payload = _payload(work)
            parts = [None] * world_size
            dist.barrier(group=group)
            start = time.perf_counter()
            devices.all_gather_object(parts, payload, group=group)
            seconds[kind].append(time.perf_counter() - start)
    sizes = {kind: len(pickle.dumps(_payload(w))) if w is not None else 0
             for kind, w in steps.items()}  # fmt: skip
    return {"seconds": seconds, "bytes": sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("samples", 64), ("tokens", 2048), ("layers", 48), ("topk", 8),
                          ("experts", 128), ("ranks", 4), ("repeats", 3)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    import tempfile

    from tests.harness.ranks import spawn

    with tempfile.TemporaryDirectory() as tmp:
        results = spawn(_worker, args.ranks, Path(tmp), args)
    tokens = args.samples * args.tokens
    sizes = results[0]["bytes"]
    medians = {k: max(statistics.median(r["seconds"][k]) for r in results) for k in sizes}
    print(f"step: {args.samples} samples x {args.tokens} tokens, {args.layers} MoE layers, "
          f"top-{args.topk} of {args.experts}, gathered over {args.ranks} gloo ranks")
    for kind in sizes:
        print(f"{kind:8s} payload {sizes[kind] / 2**20:8.1f} MiB  "
              f"{sizes[kind] / tokens:7.1f} B/token  gather {medians[kind]:.3f} s")
    extra = sizes["routing"] - sizes["plain"]
    print(f"RESULT routing_bytes_per_token={extra / tokens:.1f} "
          f"extra_gather_s={medians['routing'] - medians['plain']:.3f} "
          f"gather_ratio={medians['routing'] / medians['plain']:.2f}")


if __name__ == "__main__":
    main()
