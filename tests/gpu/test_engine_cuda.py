"""The real SGLang engine on a GPU, as the GPU test machine runs it: SGLang without its kernel
wheels (`scripts/gpu_bundle.sh`), so on `engines.sglang.kernel_free`'s paths, which the engine
host chooses by itself when sgl-kernel does not import.

Contracts (the CUDA twins of `tests/distributed/test_sglang_engine.py` and
`test_engine_restart.py`, float32, a tiny local Llama):
- greedy generation with log-probs within 1e-3 (mean abs) of `transformers`' on the same weights;
- a weight update of CUDA tensors crosses to the engine as CUDA IPC handles and reads back
  bit-identical, and generation after it carries the new version;
- the scheduler killed with SIGKILL: the engine restarts with the newest weights (read back
  bit-identical) and the call returns the tokens the engine gave before the kill (greedy);
- deterministic inference (SGLang's `enable_deterministic_inference`, triton attention): a
  seeded sampled request gives the same tokens and log-probs alone and inside a batch of
  others, which issue 13's exact resume of a synchronous run rests on.
Marked `gpu` and skipped without a GPU or without SGLang; each test prints its figures.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time

import psutil
import pytest
import torch

from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
from megatron_async_rl.engines.sglang import kernel_free
from megatron_async_rl.engines.sglang.engine import SGLangEngine
from megatron_async_rl.engines.sglang.handover import serialize
from tests.harness.engine import (
    CHECKED_WEIGHTS,
    PROMPTS,
    Served,
    engine_config,
    greedy,
    hf_logprob_diff,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                       reason="sglang not installed: carry it with scripts/gpu_bundle.sh"),
]  # fmt: skip

GPU_SHARE = 0.3  # of the GPU's memory for SGLang's weights and KV cache: leaves the rest free


def _cuda_config(model_dir, **overrides):
    return engine_config(model_dir, device="cuda", mem_fraction_static=GPU_SHARE, **overrides)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def served(model_dir):
    from safetensors.torch import load_file

    engine = SGLangEngine(_cuda_config(model_dir), rank_in_role=0, global_rank=1)
    print(f"\nengine on CUDA up in {engine.startup_s:.1f} s; sgl-kernel: "
          f"{'yes' if kernel_free.has_sgl_kernel() else 'no (kernel-free paths)'}")  # fmt: skip
    yield Served(engine, model_dir, load_file(model_dir / "model.safetensors"))
    engine.shutdown()


def _read_back(engine, state: dict[str, torch.Tensor]) -> None:
    for name in CHECKED_WEIGHTS:
        sent, got = state[name].cpu(), engine.get_weights_by_name(name).cpu()
        assert torch.equal(got[: sent.shape[0]], sent), name  # vocab rows padded to 64


def test_generate_on_cuda_matches_transformers(served):
    requests = greedy(24, "cuda-greedy")
    start = time.perf_counter()
    results = served.engine.generate(requests)
    seconds = time.perf_counter() - start
    assert all(1 <= len(r.output_ids) <= 24 for r in results)
    diff = hf_logprob_diff(served, results, requests)
    print(f"generate 3 x 24 tokens on CUDA: {seconds:.2f} s; log-prob mean abs diff vs "
          f"transformers: {diff:.2e}")  # fmt: skip
    assert diff <= 1e-3


def test_a_weight_update_of_cuda_tensors_goes_by_cuda_ipc_and_reads_back(served):
    new = {n: (t + 0.01 * torch.randn_like(t)).cuda() for n, t in served.state.items()}
    payloads, _ = serialize([("model.norm.weight", new["model.norm.weight"])], copies=1)
    assert b"rebuild_cuda_tensor" in payloads[0]  # a CUDA IPC handle, not the bytes
    nbytes = sum(t.numel() * t.element_size() for t in new.values())
    start = time.perf_counter()
    served.engine.begin_weight_update()
    served.engine.update_weights(list(new.items()), "cuda-v1")
    served.engine.end_weight_update()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    copy_start = time.perf_counter()
    for t in new.values():
        t.clone()
    torch.cuda.synchronize()
    raw = time.perf_counter() - copy_start
    served.state, served.version = new, "cuda-v1"
    print(f"weight update through CUDA IPC: {nbytes / 1e6:.1f} MB in {seconds:.3f} s "
          f"(a raw on-GPU copy of the same bytes: {raw:.4f} s)")  # fmt: skip
    assert served.engine.weight_version() == "cuda-v1"
    _read_back(served.engine, new)
    results = served.engine.generate(greedy(8, "after-cuda-v1"))
    assert all(r.token_versions == ["cuda-v1"] * len(r.output_ids) for r in results)


def test_a_killed_engine_restarts_on_cuda_with_its_weights(model_dir):
    from safetensors.torch import load_file

    from megatron_async_rl.engines.recovery.restarting import RestartingEngine
    from megatron_async_rl.weight_sync.sinks import load_tensors

    config = _cuda_config(model_dir)
    engine = RestartingEngine(
        lambda: SGLangEngine(config, rank_in_role=0, global_rank=1), load_tensors,
        where="gpu test engine", max_restarts=2, window_steps=10, health_timeout_s=10.0,
        check_every_s=1.0,
    )  # fmt: skip
    try:
        initial = load_file(model_dir / "model.safetensors")
        state = {n: t + 0.01 * torch.randn_like(t) for n, t in sorted(initial.items())}
        engine.begin_weight_update()
        engine.update_weights(list(state.items()), "v1")
        engine.end_weight_update(True)
        requests = [GenerateRequest(p, SamplingParams(max_new_tokens=32, temperature=0.0),
                                    f"restart-{i}") for i, p in enumerate(PROMPTS)]  # fmt: skip
        before = engine.generate(requests)
        scheduler = next(p for p in engine.inner.engine_child_pids
                         if "scheduler" in psutil.Process(p).name())  # fmt: skip
        os.kill(scheduler, signal.SIGKILL)
        after = engine.generate(requests)
        metrics = engine.take_metrics()
        print(f"restart on CUDA after kill -9: {metrics['engines/restart_s']:.1f} s "
              f"(start {metrics['engines/restart_start_s']:.1f} s, "
              f"load {metrics['engines/restart_load_s']:.2f} s)")  # fmt: skip
        assert metrics["engines/restarts"] == 1
        assert [r.output_ids for r in after] == [r.output_ids for r in before]
        _read_back(engine, state)
    finally:
        engine.shutdown()


def test_deterministic_inference_gives_a_request_the_same_tokens_in_any_batch(model_dir):
    config = _cuda_config(model_dir, server_args={"enable_deterministic_inference": True,
                                                  "attention_backend": "triton"})  # fmt: skip
    engine = SGLangEngine(config, rank_in_role=0, global_rank=1)

    def sampled(rid: str, prompt: list[int], seed: int) -> GenerateRequest:
        params = SamplingParams(max_new_tokens=32, temperature=1.0, seed=seed)
        return GenerateRequest(prompt, params, rid)

    try:
        alone = engine.generate([sampled("alone", PROMPTS[0], 7)])[0]
        others = [sampled(f"other-{i}", PROMPTS[i % 3] + [40 + i], 100 + i) for i in range(12)]
        batch = engine.generate([*others[:5], sampled("in-batch", PROMPTS[0], 7), *others[5:]])
        mine = next(r for r in batch if r.rid == "in-batch")
        gap = max(abs(a - b) for a, b in zip(alone.output_logprobs, mine.output_logprobs)) \
            if alone.output_ids == mine.output_ids else float("nan")  # fmt: skip
        print(f"deterministic inference: {len(alone.output_ids)} sampled tokens alone and in a "
              f"batch of 13: same tokens {alone.output_ids == mine.output_ids}, largest "
              f"log-prob gap {gap}")  # fmt: skip
        assert mine.output_ids == alone.output_ids
        assert mine.output_logprobs == alone.output_logprobs
    finally:
        engine.shutdown()
