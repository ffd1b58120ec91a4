"""`engines/sglang/batched_attention.py` against SGLang's own per-request loop, on the same KV
cache: bit for bit, for decode and extend (with cached prefixes), GQA, random slot layouts,
groups of equal lengths among requests alone, NaN in the unused cache slots; the batches it
leaves to the loop (a sliding window) go there.

Runs in a subprocess with the CPU engine's environment (`SGLANG_USE_CPU_ENGINE=1`, the CPU
shims first on the path), as SGLang's engine processes import it. The engine's own twin, the
backend under a served engine against `transformers` and the trainer, is
`tests/distributed/test_sglang_engine.py`: every served-engine test there runs on it (log-probs
against `transformers` within 1e-3, bit-exact weight updates, DeepSeek's multi-latent
attention), and its shims probe checks that SGLang's registry builds it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_async_rl.engines.sglang.host import CPU_ATTENTION_ENV, CPU_SHIMS_DIR

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang is not installed")  # fmt: skip

SCRIPT = r"""
import json, torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from megatron_async_rl.engines.sglang.batched_attention import BatchedTorchNativeAttnBackend

torch.manual_seed(0)
loop = object.__new__(TorchNativeAttnBackend)
batched = object.__new__(BatchedTorchNativeAttnBackend)
heads, kv_heads, dim, slots = 4, 2, 16, 512
k_cache = torch.randn(slots, kv_heads, dim)
v_cache = torch.randn(slots, kv_heads, dim)
# groups of equal lengths (and prefixes) and requests alone, interleaved
seq_lens = torch.tensor([5, 1, 17, 9, 17, 2, 5, 9, 33])
prefix = torch.tensor([0, 0, 12, 5, 12, 1, 0, 5, 30])
extend = seq_lens - prefix
batch = len(seq_lens)
req_to_token = torch.zeros(16, 64, dtype=torch.int64)
pool = torch.tensor([7, 3, 11, 0, 5, 9, 12, 1, 4])
used = torch.randperm(slots - 1)[: int(seq_lens.sum())] + 1
at = 0
for b in range(batch):
    n = int(seq_lens[b]); req_to_token[pool[b], :n] = used[at:at + n]; at += n
k_cache[0] = float("nan"); v_cache[0] = float("nan")  # slot 0: SGLang's padding slot
scale = dim ** -0.5
out = {}
for gqa in (True, False):
    kv = k_cache if gqa else k_cache.repeat_interleave(2, dim=1)
    vv = v_cache if gqa else v_cache.repeat_interleave(2, dim=1)
    q = torch.randn(batch, heads, dim)
    a = loop._run_sdpa_forward_decode(q, torch.empty_like(q), kv, vv, req_to_token, pool, seq_lens,
                                      scaling=scale, enable_gqa=gqa)
    b = batched._run_sdpa_forward_decode(q, torch.empty_like(q), kv, vv, req_to_token, pool,
                                         seq_lens, scaling=scale, enable_gqa=gqa)
    out[f"decode_gqa={gqa}"] = (a - b).abs().max().item()
    for causal in (True, False):
        q = torch.randn(int(extend.sum()), heads, dim)
        args = (kv, vv, req_to_token, pool, seq_lens, prefix, extend)
        a = loop._run_sdpa_forward_extend(q, torch.empty_like(q), *args, scaling=scale,
                                          enable_gqa=gqa, causal=causal)
        b = batched._run_sdpa_forward_extend(q, torch.empty_like(q), *args, scaling=scale,
                                             enable_gqa=gqa, causal=causal)
        out[f"extend_gqa={gqa}_causal={causal}"] = (a - b).abs().max().item()
q = torch.randn(batch, heads, dim)
a = loop._run_sdpa_forward_decode(q, torch.empty_like(q), k_cache, v_cache, req_to_token, pool,
                                  seq_lens, scaling=scale, enable_gqa=True, sliding_window_size=3)
b = batched._run_sdpa_forward_decode(q, torch.empty_like(q), k_cache, v_cache, req_to_token, pool,
                                     seq_lens, scaling=scale, enable_gqa=True,
                                     sliding_window_size=3)
out["decode_sliding_window_goes_to_the_loop"] = (a - b).abs().max().item()
print("RESULT " + json.dumps(out))
"""


def test_batched_attention_equals_sglangs_loop():
    path = os.pathsep.join(p for p in (str(CPU_SHIMS_DIR), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1", PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", SCRIPT], env=env, text=True,
                          capture_output=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    diffs = json.loads(line[len("RESULT "):])
    print(diffs)
    assert len(diffs) == 7
    for case, diff in diffs.items():
        assert diff == 0.0, (case, diff)  # NaN fails too


@pytest.mark.parametrize("choice, registered", [("batched", True), ("per_request", False),
                                                (None, True)])  # fmt: skip
def test_the_shims_register_the_batched_backend_unless_asked(monkeypatch, choice, registered):
    """`engine.cpu_attention` reaches the engine's processes as `host.CPU_ATTENTION_ENV`; the
    shims' patch of SGLang's registry reads it (the real registry: the probe of
    `test_sglang_engine.py::test_cpu_shims_patches_show_the_upstream_defects_and_fix_them`)."""
    spec = importlib.util.spec_from_file_location("shims_site", CPU_SHIMS_DIR / "sitecustomize.py")
    site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(site)  # defines the hook only: no sglang module is loaded
    if choice is None:
        monkeypatch.delenv(CPU_ATTENTION_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_ATTENTION_ENV, choice)
    names = []

    def register_attention_backend(name):
        names.append(name)
        return lambda factory: factory

    registry = SimpleNamespace(register_attention_backend=register_attention_backend)
    site._PATCHES["sglang.srt.layers.attention.attention_registry"](registry)
    assert names == (["torch_native"] if registered else [])


def test_cpu_attention_reaches_the_engine_config():
    from megatron_async_rl.config.errors import ConfigError
    from megatron_async_rl.engines.config import EngineConfig

    assert EngineConfig().sglang_config("m", "cpu", 0).cpu_attention == "batched"
    assert EngineConfig(cpu_attention="per_request").sglang_config(
        "m", "cpu", 0).cpu_attention == "per_request"
    with pytest.raises(ConfigError, match="cpu_attention = 'loop': must be one of batched"):
        EngineConfig(cpu_attention="loop")
