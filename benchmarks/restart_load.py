"""What an engine restart in place costs, split, and its weight load against a plain load.

    .venv/bin/python benchmarks/restart_load.py [--hidden-size 512 --num-layers 8] [--repeats 3]

One real SGLang engine on CPU, under `engines.recovery.restarting.RestartingEngine` (as the generate
rank drives it), serving a Llama it writes itself (float32). It loads one version through the
wrapper, which keeps the host copy a restart reloads. Then, alternately, `repeats` times each:
- the restart's reload: `weight_sync.sinks.load_tensors` of that kept copy (chunked into
  `consume_bucket_mb` messages through shared memory), exactly what `_restore` calls;
- a plain load of the same tensors: one `update_weights` call between begin and end.
Then one real restart in the middle of a generation: the engine's scheduler is SIGKILLed a
second into a greedy generate call of `--requests` requests, the call is carried on, and the
wrapper's split is read back: `engines/restart_start_s` (new process), `engines/restart_load_s`
(weights), `engines/restart_resubmit_s` (the carried-on call: each request continued from the
prefix the dead engine reported, `engines/tokens_kept`).
Prints the medians, the bytes and `RESULT restart_load_vs_plain_load=<plain s / reload s>`
(1: the reload is as fast as one plain load). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()

    from safetensors.torch import load_file

    from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
    from megatron_async_rl.engines.recovery.restarting import RestartingEngine
    from megatron_async_rl.engines.sglang.engine import SGLangEngine, SGLangEngineConfig
    from megatron_async_rl.models.tiny import write_tiny_model
    from megatron_async_rl.weight_sync.sinks import load_tensors

    tmp = Path(tempfile.mkdtemp(prefix="restart-load-"))
    heads = max(args.hidden_size // 64, 1)
    model = write_tiny_model(
        tmp / "model", "llama", hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 2.6875), num_hidden_layers=args.num_layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
    )  # fmt: skip
    state = {name: t + 0.01 for name, t in load_file(model / "model.safetensors").items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    config = SGLangEngineConfig(
        model_path=str(model), dtype="float32", max_total_tokens=4096,
        startup_timeout_s=600, call_timeout_s=600, generate_timeout_s=600,
        progress_every_tokens=8,
    )  # fmt: skip

    def start():
        return SGLangEngine(config, rank_in_role=0, global_rank=0)

    engine = RestartingEngine(start, load_tensors, where="benchmark", max_restarts=3,
                              window_steps=100, health_timeout_s=600, check_every_s=0)  # fmt: skip
    try:
        print(f"model: {nbytes / 2**20:.0f} MiB in {len(state)} tensors; engine up in "
              f"{engine.inner.startup_s:.1f} s", flush=True)  # fmt: skip
        engine.begin_weight_update()
        engine.update_weights(list(state.items()), "v1")
        engine.end_weight_update(True)
        kept = engine._last  # the host copy a restart reloads
        reload_s, plain_s = [], []
        for _ in range(args.repeats):
            start_t = time.perf_counter()
            load_tensors(engine.inner, kept, "v1")
            reload_s.append(time.perf_counter() - start_t)
            start_t = time.perf_counter()
            engine.inner.begin_weight_update()
            engine.inner.update_weights(list(kept.items()), "v1")
            engine.inner.end_weight_update(True)
            plain_s.append(time.perf_counter() - start_t)
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
        requests = [GenerateRequest([1, 10 + i, 20 + i], sampling, f"g{i}")
                    for i in range(args.requests)]  # fmt: skip
        start_t = time.perf_counter()
        engine.generate(requests)
        plain_generate_s = time.perf_counter() - start_t
        engine.take_metrics()
        killer = threading.Timer(1.0, engine.inner.signal_scheduler, (signal.SIGKILL,))
        killer.start()
        results = engine.generate(requests)
        assert all(v == "v1" for r in results for v in r.token_versions)
        m = engine.take_metrics()
    finally:
        engine.shutdown()
    reload_med, plain_med = statistics.median(reload_s), statistics.median(plain_s)
    print(f"restart reload (load_tensors of the kept copy): median {reload_med:.3f} s "
          f"{[round(x, 3) for x in reload_s]}")  # fmt: skip
    print(f"plain load (one update_weights call): median {plain_med:.3f} s "
          f"{[round(x, 3) for x in plain_s]}")  # fmt: skip
    print(f"one restart mid-generation: {m.get('engines/restart_s', 0):.1f} s = process start "
          f"{m.get('engines/restart_start_s', 0):.1f} s + weight load "
          f"{m.get('engines/restart_load_s', 0):.2f} s; then the resubmitted requests "
          f"{m.get('engines/restart_resubmit_s', 0):.2f} s ("
          f"{m.get('engines/requests_resubmitted', 0):.0f} requests, "
          f"{m.get('engines/tokens_kept', 0):.0f} tokens kept; the whole call without a "
          f"fault: {plain_generate_s:.2f} s)")  # fmt: skip
    print(f"RESULT restart_load_vs_plain_load={plain_med / reload_med:.2f} "
          f"restart_s={m.get('engines/restart_s', 0):.1f} "
          f"restart_load_s={m.get('engines/restart_load_s', 0):.2f} "
          f"restart_resubmit_s={m.get('engines/restart_resubmit_s', 0):.2f} "
          f"tokens_kept={m.get('engines/tokens_kept', 0):.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
