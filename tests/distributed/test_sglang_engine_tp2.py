"""An SGLang engine with tensor parallelism 2 on CPU, behind `SGLangEngine`.

Contract checked: with `tp_size=2` and SGLANG_CPU_OMP_THREADS_BIND unset, the engine host binds
the two TP ranks itself and the engine starts; full HF-named tensors sent through
begin/update/end (SGLang shards them) read back through `get_weights_by_name` as the full HF
tensors, bit for bit (assembled from every TP rank's own parameters, which SGLang's
`save_sharded_model` dumps), replicated ones equal on both ranks, and a read-back after an update
sees the new weights, not a stale dump; its greedy generation after the update equals that of a
TP=1 engine loaded with the same weights (same tokens, log-probs within 1e-4). Nothing is faked:
real SGLang 0.5.21 on CPU, fp32, the session's tiny Llama (`tiny_model`). Each engine starts
once (~20-45 s on 2 cores each).

The pure checks that were here (`test_assemble_hf_tensor_undoes_sglang_tp_layouts`,
`test_cpu_threads_bind_splits_the_cores`, `test_cpu_tp_bind_with_too_few_groups_is_rejected`)
moved, assertions unchanged, to `tests/unit/test_sglang_shards.py`.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="sglang is not installed; run scripts/install_sglang_cpu.sh",
    ),
]
PROMPTS = ([1, 10, 11, 12, 13], [1, 20, 21], [1, 30, 31, 32, 33, 34, 35])


def _config(model_dir, tp_size: int):
    from megatron_async_rl.engines.sglang_engine import SGLangEngineConfig

    return SGLangEngineConfig(
        model_path=str(model_dir),
        tp_size=tp_size,
        dtype="float32",
        max_total_tokens=4096,
        startup_timeout_s=300,
        call_timeout_s=120,
        generate_timeout_s=300,
    )


def _served(engine, state: dict[str, torch.Tensor], version: str):
    """Load `state` (full HF tensors) through begin/update/end, then greedy-generate."""
    engine.begin_weight_update()
    engine.update_weights(list(state.items()), version)
    engine.end_weight_update()
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0)
    requests = [GenerateRequest(p, sampling, f"{version}-{i}") for i, p in enumerate(PROMPTS)]
    return engine.generate(requests)


def _assert_same_as_sent(got: torch.Tensor, sent: torch.Tensor, name: str) -> None:
    # The vocab rows of embedding and LM head come back padded with zeros.
    rows = sent.shape[0]
    assert got.shape[1:] == sent.shape[1:], (name, got.shape, sent.shape)
    assert torch.equal(got[:rows], sent), name
    assert not got[rows:].any(), name


def test_tp2_engine_reads_back_full_tensors_and_generates_like_tp1(tiny_model, monkeypatch):
    from safetensors.torch import load_file

    from megatron_async_rl.engines.sglang_engine import SGLangEngine

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    model_dir = tiny_model("llama")
    start_state = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    new_state = {
        name: t + 0.01 * torch.randn(t.shape, generator=generator)
        for name, t in start_state.items()
    }

    engine = SGLangEngine(_config(model_dir, tp_size=2), rank_in_role=0, global_rank=1)
    try:
        print(f"\nTP=2 engine startup: {engine.startup_s:.1f} s")
        q_name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(engine.get_weights_by_name(q_name), start_state[q_name])
        started = time.perf_counter()
        tp2 = _served(engine, new_state, "v1")
        print(f"TP=2 update + generate: {time.perf_counter() - started:.2f} s")
        started = time.perf_counter()
        for name, sent in new_state.items():  # every tensor, not a sample
            _assert_same_as_sent(engine.get_weights_by_name(name), sent, name)
        print(f"TP=2 read-back of {len(new_state)} tensors: {time.perf_counter() - started:.2f} s")
        with pytest.raises(KeyError, match="no weight 'no.such.weight' on every TP rank"):
            engine.get_weights_by_name("no.such.weight")
    finally:
        engine.shutdown()
    assert all(r.token_versions == ["v1"] * len(r.output_ids) for r in tp2)

    engine = SGLangEngine(_config(model_dir, tp_size=1), rank_in_role=0, global_rank=2)
    try:
        tp1 = _served(engine, new_state, "v1")
    finally:
        engine.shutdown()
    worst = 0.0
    for one, two in zip(tp1, tp2):
        assert one.output_ids == two.output_ids, (one.rid, one.output_ids, two.output_ids)
        diff = torch.tensor(one.output_logprobs) - torch.tensor(two.output_logprobs)
        worst = max(worst, diff.abs().max().item())
    print(f"TP=1 vs TP=2 greedy log-probs: max abs diff {worst:.2e}")
    assert worst <= 1e-4
