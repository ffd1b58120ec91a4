"""What a step's samples cost to prepare for an object collective: a walk that copies every
tensor to the host, then `pickle` (as the object collectives did), against `devices.host_bytes`
(one pickling, tensors mapped to the host by the pickler), side by side in one process.

    .venv/bin/python benchmarks/object_exchange.py [--reps 20]

Two payloads as the exchange sends them (`jobs/exchange._payload`): the quick start's step (128
samples, 5-token prompts, 4-token responses) and a longer one (64 samples, 256-token prompts,
2048-token responses). Prints each one's median milliseconds; last line `RESULT
quickstart_walk_ms=.. quickstart_bytes_ms=.. long_walk_ms=.. long_bytes_ms=.. long_speedup=..`.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_async_rl.distributed import devices  # noqa: E402
from megatron_async_rl.rollout.generation import Sample  # noqa: E402


def payload(num_samples: int, prompt_len: int, response_len: int):
    samples = [
        Sample(uid=f"u{i}", prompt_index=i // 8, sample_index=i % 8,
               prompt_ids=list(range(prompt_len)), response_ids=list(range(response_len)),
               response_logprobs=[-0.5] * response_len, token_versions=["v3"] * response_len,
               finish_reason="length", answer="8", metadata={"answer": "8"},
               response_text="8", reward=1.0)
        for i in range(num_samples)
    ]  # fmt: skip
    return 5, [s.to_dict() for s in samples], {"means": {f"metric/{i}": 1.0 for i in range(50)}}


def timed(fn, reps: int) -> float:
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    result = {}
    for name, sizes in (("quickstart", (128, 5, 4)), ("long", (64, 256, 2048))):
        obj = payload(*sizes)
        walk = timed(lambda: pickle.dumps(devices._map(obj, devices._to_host)), args.reps)  # noqa: B023
        wire = timed(lambda: pickle.dumps(devices.host_bytes(obj)), args.reps)  # noqa: B023
        print(f"{name} ({sizes[0]} samples, {sizes[1]} + {sizes[2]} tokens): walked then "
              f"pickled {walk:.2f} ms, host_bytes {wire:.2f} ms")  # fmt: skip
        result[f"{name}_walk_ms"], result[f"{name}_bytes_ms"] = walk, wire
    result["long_speedup"] = result["long_walk_ms"] / result["long_bytes_ms"]
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
