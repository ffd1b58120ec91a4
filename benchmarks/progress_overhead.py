"""What reporting generation progress costs: streamed generate calls against plain ones.

    .venv/bin/python benchmarks/progress_overhead.py [--requests 128] [--max-new-tokens 48]

An engine host streams each request every `engine.progress_every_tokens` tokens and reports
the newest tokens to the rank (`engines.recovery.progress`), so that a request cut by an engine
death goes on from its prefix. This runs two real SGLang engines on CPU side by side, serving the
same self-written float32 Llama: one with progress reports (`--every`, default 8, the recipe
default), one without (0). Each call sends the same `--requests` sampled requests (fixed
seeds); the engines take turns, `--repeats` calls each, so both see the same machine.
Prints the medians and `RESULT progress_vs_plain=<reported s / plain s>` (1: free).
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args()

    from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
    from megatron_async_rl.engines.sglang.engine import SGLangEngine, SGLangEngineConfig
    from megatron_async_rl.models.tiny import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="progress-overhead-"))
    heads = max(args.hidden_size // 32, 1)
    model = write_tiny_model(
        tmp / "model", "llama", hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 2, num_hidden_layers=args.num_layers,
        num_attention_heads=heads, num_key_value_heads=heads,
    )  # fmt: skip
    engines = {}
    for every in (args.every, 0):
        config = SGLangEngineConfig(model_path=str(model), dtype="float32", max_total_tokens=65536,
                                    progress_every_tokens=every)  # fmt: skip
        engines[every] = SGLangEngine(config, rank_in_role=0, global_rank=every)
    requests = [
        GenerateRequest([1, 10 + i % 50, 20 + i % 7],
                        SamplingParams(max_new_tokens=args.max_new_tokens, seed=i), f"q{i}")
        for i in range(args.requests)
    ]  # fmt: skip
    times: dict[int, list[float]] = {every: [] for every in engines}
    tokens: dict[int, int] = {}
    try:
        for engine in engines.values():
            engine.generate(requests)  # warm-up
        for _ in range(args.repeats):
            for every, engine in engines.items():
                start = time.perf_counter()
                results = engine.generate(requests)
                times[every].append(time.perf_counter() - start)
                tokens[every] = sum(len(r.output_ids) for r in results)
    finally:
        for engine in engines.values():
            engine.shutdown()
    reported, plain = statistics.median(times[args.every]), statistics.median(times[0])
    for every, spent in times.items():
        print(f"progress_every_tokens={every}: median {statistics.median(spent):.3f} s per "
              f"call, {tokens[every]} tokens {[round(t, 3) for t in spent]}")  # fmt: skip
    print(f"RESULT progress_vs_plain={reported / plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
