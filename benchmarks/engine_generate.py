"""Where the CPU engine's generate time goes: SGLang's per-request attention loop against the
batched backend (`engine.cpu_attention`), or SGLang's defaults against `--server-args`, side by
side in one run.

    .venv/bin/python benchmarks/engine_generate.py [--hidden 384] [--layers 6] [--tokens 48]
                                                   [--reps 4] [--out runs/bench-engine-generate]
    .venv/bin/python benchmarks/engine_generate.py --model runs/tiny-llama-warm --tokens 4
    .venv/bin/python benchmarks/engine_generate.py --model runs/tiny-llama-warm --tokens 4 \
        --server-args '{"disable_radix_cache": true}'

Starts two real SGLang engines on one core (`taskset` of this process: the core a generate rank
has), one per `cpu_attention` (or: SGLang's defaults, and with `--server-args`), on the same
local Llama, and calls them in turn, `--reps` times
each: one quick-start batch a call (16 prompts x 8 samples, temperature 1, every response
`--tokens` long: `ignore_eos`). Prints each call's seconds and the medians; last line
`RESULT per_request_s=.. batched_s=.. speedup=..` (per_request / batched), or with
`--server-args` (extra `sglang.Engine` arguments, as `engine.server_args`; both engines batched)
`RESULT default_s=.. server_args_s=.. speedup=..` (default / with them).

A py-spy profile of the quick start's generate call (the scheduler process, 128 requests x 4
tokens) put about 40% of the scheduler's loop in the torch-native backend's per-request loop
when it was measured on a loaded machine; this script is the figure that decides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.learn_passes import llama_model  # noqa: E402
from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from megatron_async_rl.engines.sglang.engine import SGLangEngine  # noqa: E402
from tests.harness.engine import engine_config  # noqa: E402

PROMPTS = [[1, 10 + i % 9, 14, 10 + i // 9 % 9, 25] for i in range(16)]  # "a+b=" shaped


def batch(tag: str, tokens: int) -> list[GenerateRequest]:
    return [GenerateRequest(PROMPTS[i], SamplingParams(max_new_tokens=tokens, temperature=1.0,
                                                       seed=8 * i + k, ignore_eos=True),
                            f"{tag}-{i}-{k}") for i in range(16) for k in range(8)]  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a HF Llama directory (default: built)")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-engine-generate")
    parser.add_argument("--server-args", type=json.loads, default=None,
                        help="a JSON object: compare SGLang's defaults against these")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if len(os.sched_getaffinity(0)) > 1:  # one core, as a generate rank has
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or llama_model(args.out, args.hidden, args.layers)
    engines = {}
    try:
        for mode, overrides in variants(args.server_args).items():
            config = engine_config(model, max_total_tokens=16384, **overrides)
            engines[mode] = SGLangEngine(config, rank_in_role=0, global_rank=1)
        seconds = {mode: [] for mode in engines}
        for rep in range(args.reps + 1):  # call 0 warms up
            for mode, engine in engines.items():
                start = time.perf_counter()
                results = engine.generate(batch(f"{mode}{rep}", args.tokens))
                took = time.perf_counter() - start
                assert all(len(r.output_ids) == args.tokens for r in results)
                print(f"call {rep} {mode:12s} {took:7.3f} s", flush=True)
                if rep:
                    seconds[mode].append(took)
    finally:
        for engine in engines.values():
            engine.shutdown()
    (base, base_s), (other, other_s) = ((m, statistics.median(s)) for m, s in seconds.items())
    print(f"{model}: 128 requests x {args.tokens} tokens, medians of {args.reps} calls: "
          f"{base} {base_s:.3f} s, {other} {other_s:.3f} s")
    print(f"RESULT {base}_s={base_s:.3f} {other}_s={other_s:.3f} speedup={base_s / other_s:.2f}")
    return 0


def variants(server_args: dict | None) -> dict[str, dict]:
    """The two engines' `engine_config` overrides, the baseline first."""
    if server_args is None:
        return {mode: {"cpu_attention": mode} for mode in ("per_request", "batched")}
    return {"default": {}, "server_args": {"server_args": server_args}}


if __name__ == "__main__":
    sys.exit(main())
