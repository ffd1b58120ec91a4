"""What an in-flight weight load costs one real SGLang engine on CPU, by pause mode.

    .venv/bin/python benchmarks/engine_pause_load.py [MODEL_DIR] [in_place|retract]

MODEL_DIR defaults to the quick start's warm model (runs/tiny-llama-warm); pass runs/tiny-llama
(untrained: long answers) to have requests in flight when the load lands. Prints generate times
of 16 requests x 48 tokens before and after loads, the in-flight load's time, how many samples
mixed versions, and (in_place only) the stand-alone `flush_cache` that must follow: on CPU
SGLang runs `gc.collect()` there, about 0.5 s, which is why `scheduler.in_flight_pause`
defaults to retract (the flush then rides with the load, without the collection).
A benchmark for reading, not a test.
"""

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from safetensors.torch import load_file

from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_async_rl.engines.sglang.engine import SGLangEngine, SGLangEngineConfig

MODEL = sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-llama-warm"
SAMP = SamplingParams(max_new_tokens=48, temperature=1.0)
N = [0]


def batch():
    N[0] += 1
    return [GenerateRequest([1, 5 + i % 7, 9, 12], SAMP, f"r{N[0]}-{i}") for i in range(16)]


def timed(eng, label):
    t = time.perf_counter()
    out = eng.generate(batch())
    dt = time.perf_counter() - t
    vs = sorted({v for r in out for v in r.token_versions})
    print(
        f"{label}: {dt:.3f} s, tokens {sum(len(r.output_ids) for r in out)}, versions {vs}",
        flush=True,
    )
    return out


MODE = sys.argv[2] if len(sys.argv) > 2 else "in_place"


def load(eng, state, version, in_place):
    if in_place:
        eng.pause(MODE)
    eng.begin_weight_update()
    eng.update_weights(
        list(state.items()), version, flush_cache=not (in_place and MODE == "in_place")
    )
    eng.end_weight_update()
    if in_place:
        eng.resume()


def main():
    state = load_file(f"{MODEL}/model.safetensors")
    eng = SGLangEngine(
        SGLangEngineConfig(
            model_path=MODEL,
            dtype="float32",
            max_total_tokens=4096,
            startup_timeout_s=300,
            call_timeout_s=120,
            generate_timeout_s=300,
        ),
        rank_in_role=0,
        global_rank=1,
    )
    try:
        for i in range(3):
            timed(eng, f"baseline {i}")
        load(eng, state, "w1", False)
        for i in range(2):
            timed(eng, f"after wait-load {i}")
        for k in range(3):
            box = {}
            label = f"inflight batch {k}"
            th = threading.Thread(target=lambda b=box, x=label: b.update(out=timed(eng, x)))
            th.start()
            time.sleep(0.05)
            t = time.perf_counter()
            load(eng, state, f"f{k}", True)
            print(f"  in-flight load ({MODE}) {time.perf_counter() - t:.3f} s", flush=True)
            th.join()
            print(
                f"  mixed samples {sum(len(set(r.token_versions)) > 1 for r in box['out'])}",
                flush=True,
            )
            if MODE == "in_place":
                t = time.perf_counter()
                eng.flush_cache()
                print(f"  flush {time.perf_counter() - t:.3f} s", flush=True)
            for i in range(2):
                timed(eng, f"  after in-flight load {k}.{i}")
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
