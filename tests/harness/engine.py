"""The real SGLang engine's tests' shared pieces: prompts, the weights read back, the engine's
config for a tiny local model, greedy requests, and the log-prob gap to `transformers` on the
same weights (`tests/distributed/test_sglang_engine.py` on CPU, `tests/gpu/test_engine_cuda.py`
on CUDA).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from megatron_async_rl.engines.protocol import INITIAL_VERSION, GenerateRequest, SamplingParams
from megatron_async_rl.engines.sglang.engine import SGLangEngine, SGLangEngineConfig

PROMPTS = ([1, 10, 11, 12, 13], [1, 20, 21], [1, 30, 31, 32, 33, 34, 35])
CHECKED_WEIGHTS = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
)


def engine_config(model_dir: Path, **overrides) -> SGLangEngineConfig:
    fields = dict(
        model_path=str(model_dir),
        dtype="float32",
        max_total_tokens=4096,
        startup_timeout_s=300,
        call_timeout_s=120,
        generate_timeout_s=300,
    )
    return SGLangEngineConfig(**{**fields, **overrides})


@dataclasses.dataclass
class Served:
    """The module's engine and what it is serving now (tests that update weights record it)."""

    engine: SGLangEngine
    model_dir: Path
    state: dict[str, torch.Tensor]
    version: str = INITIAL_VERSION


def greedy(max_new_tokens: int, tag: str) -> list[GenerateRequest]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    return [GenerateRequest(p, sampling, f"{tag}-{i}") for i, p in enumerate(PROMPTS)]


def hf_model(served: Served):
    """`transformers`' model of `served.state`, loaded the way it loads a checkpoint: the state
    is written next to the model's config, so transformers converts checkpoint names itself
    (its MoE models keep experts fused, e.g. DeepSeek-V3's `experts.gate_up_proj`)."""
    import tempfile

    import transformers
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        for path in served.model_dir.iterdir():
            if not path.name.startswith("model.safetensors"):
                os.symlink(path, Path(tmp) / path.name)
        save_file({n: t.contiguous() for n, t in served.state.items()}, f"{tmp}/model.safetensors")
        return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def hf_logprob_diff(served: Served, results, requests) -> float:
    """Mean |engine log-prob - transformers log-prob| over all generated tokens."""
    model = hf_model(served)
    diffs = []
    with torch.no_grad():
        for request, result in zip(requests, results):
            ids = torch.tensor([request.input_ids + result.output_ids])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            start = len(request.input_ids) - 1
            ref = logp[start : start + len(result.output_ids)].gather(
                1, torch.tensor(result.output_ids)[:, None]
            )[:, 0]
            diffs.append((ref - torch.tensor(result.output_logprobs)).abs())
    return torch.cat(diffs).mean().item()
