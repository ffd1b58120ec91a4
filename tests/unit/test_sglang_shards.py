"""SGLang's TP=2 weight shards reassembled into HF tensors, and the engine's CPU core binding.

Contracts (pure: no ranks, no engine, no sglang import; moved out of the TP=2 engine test, now
in `tests/distributed/test_sglang_engine.py`, where the `needs_sglang` skip hid them):
`sglang_host.assemble_hf_tensor` rebuilds every full HF tensor from hand-built per-rank
parameters in SGLang's TP=2 layouts, for the layouts the tiny model does not exercise (a kv head
replicated over TP ranks, tied embeddings), and names a replicated parameter that differs between
ranks; `sglang_host.cpu_threads_bind` splits the usable cores into one contiguous group per TP
rank; `SGLangEngineConfig` rejects an `SGLANG_CPU_OMP_THREADS_BIND` naming too few groups.
Nothing is faked. The assertions are those of the tests of the same names that were there.
"""

from __future__ import annotations

import pytest
import torch

from megatron_async_rl.engines.sglang.host import cpu_threads_bind
from megatron_async_rl.engines.sglang.tp_shards import assemble_hf_tensor


def _rank_shards(full: dict[str, torch.Tensor], heads: int, kv_heads: int, head_dim: int):
    """SGLang's per-rank parameters for TP=2, written out by hand from its layer layouts."""
    shards = []
    kv_replicas = max(1, 2 // kv_heads)
    for rank in range(2):
        q = full["q"].chunk(2)[rank]
        kv_head = rank // kv_replicas if kv_heads < 2 else None
        if kv_head is None:
            k, v = full["k"].chunk(2)[rank], full["v"].chunk(2)[rank]
        else:
            rows = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
            k, v = full["k"][rows], full["v"][rows]
        gate, up = full["gate"].chunk(2)[rank], full["up"].chunk(2)[rank]
        shards.append(
            {
                "model.layers.0.self_attn.qkv_proj.weight": torch.cat([q, k, v]),
                "model.layers.0.mlp.gate_up_proj.weight": torch.cat([gate, up]),
                "model.layers.0.self_attn.o_proj.weight": full["o"].chunk(2, dim=1)[rank],
                "model.embed_tokens.weight": full["embed"].chunk(2)[rank],
                "model.norm.weight": full["norm"],
            }
        )
    return shards


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["kv_replicated", "kv_split"])
def test_assemble_hf_tensor_undoes_sglang_tp_layouts(kv_heads):
    heads, head_dim, hidden = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    full = {
        "q": torch.randn(heads * head_dim, hidden, generator=gen),
        "k": torch.randn(kv_heads * head_dim, hidden, generator=gen),
        "v": torch.randn(kv_heads * head_dim, hidden, generator=gen),
        "gate": torch.randn(6, hidden, generator=gen),
        "up": torch.randn(6, hidden, generator=gen),
        "o": torch.randn(hidden, heads * head_dim, generator=gen),
        "embed": torch.randn(10, hidden, generator=gen),  # padded vocab rows, as SGLang holds
        "norm": torch.randn(hidden, generator=gen),
    }
    shards = _rank_shards(full, heads, kv_heads, head_dim)
    hf_config = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": heads * head_dim,
        "tie_word_embeddings": True,
    }

    def read(rank, key):
        return shards[rank].get(key)

    expected = {
        "model.layers.0.self_attn.q_proj.weight": full["q"],
        "model.layers.0.self_attn.k_proj.weight": full["k"],
        "model.layers.0.self_attn.v_proj.weight": full["v"],
        "model.layers.0.mlp.gate_proj.weight": full["gate"],
        "model.layers.0.mlp.up_proj.weight": full["up"],
        "model.layers.0.self_attn.o_proj.weight": full["o"],
        "model.embed_tokens.weight": full["embed"],
        "lm_head.weight": full["embed"],  # tied: SGLang's dump keeps one of the two names
        "model.norm.weight": full["norm"],
    }
    for name, tensor in expected.items():
        assert torch.equal(assemble_hf_tensor(name, read, 2, hf_config), tensor), name
    shards[1]["model.norm.weight"] = full["norm"] + 1
    with pytest.raises(RuntimeError, match="'model.norm.weight' differs between SGLang TP ranks"):
        assemble_hf_tensor("model.norm.weight", read, 2, hf_config)


@pytest.mark.parametrize(
    "tp_size, cpus, expected",
    [(2, [0, 1], "0|1"), (2, list(range(8)), "0-3|4-7"), (3, [0, 2, 4, 5], "0,2|4|5"),
     (2, [3], "3|3")],
)  # fmt: skip
def test_cpu_threads_bind_splits_the_cores(tp_size, cpus, expected):
    assert cpu_threads_bind(tp_size, cpus) == expected


def test_cpu_tp_bind_with_too_few_groups_is_rejected(monkeypatch):
    from megatron_async_rl.engines.config import SGLangEngineConfig

    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0")
    with pytest.raises(ValueError, match="names the cores of 1 rank"):
        SGLangEngineConfig(model_path="m", tp_size=2)
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    assert SGLangEngineConfig(model_path="m", tp_size=2).tp_size == 2
