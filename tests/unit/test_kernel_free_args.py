"""SGLang on a GPU without its kernel wheels: the server arguments the engine chooses
(`engines.sglang.kernel_free.kernel_free_args`, through `host.engine_kwargs`), by what is
importable.

Contracts: on CUDA without sgl-kernel, triton attention, torch sampling, no CUDA graphs and no
custom all-reduce; on CUDA with sgl-kernel and on CPU, none of them (CPU keeps its torch-native
attention); a recipe's `engine.server_args` win over them; SGLang's own `ServerArgs` takes
every one (the real class, not a copy of its names).
"""

from __future__ import annotations

import importlib.util

import pytest

from megatron_async_rl.engines.config import SGLangEngineConfig
from megatron_async_rl.engines.sglang.host import engine_kwargs
from megatron_async_rl.engines.sglang.kernel_free import KERNEL_FREE_ARGS


def _config(device: str, **server_args) -> SGLangEngineConfig:
    return SGLangEngineConfig(model_path="/models/tiny", device=device, server_args=server_args)


def test_cuda_without_sgl_kernel_takes_the_torch_and_triton_paths():
    kwargs = engine_kwargs(_config("cuda"), has_sgl_kernel=False)
    assert {k: kwargs[k] for k in KERNEL_FREE_ARGS} == {
        "attention_backend": "triton", "sampling_backend": "pytorch",
        "disable_cuda_graph": True, "disable_custom_all_reduce": True}  # fmt: skip


def test_cuda_with_sgl_kernel_and_cpu_keep_their_own():
    assert not set(KERNEL_FREE_ARGS) & set(engine_kwargs(_config("cuda"), has_sgl_kernel=True))
    cpu = engine_kwargs(_config("cpu"), has_sgl_kernel=False)
    assert cpu["attention_backend"] == "torch_native" and "sampling_backend" not in cpu


def test_the_recipes_server_args_win():
    kwargs = engine_kwargs(_config("cuda", attention_backend="flashinfer"), has_sgl_kernel=False)
    assert kwargs["attention_backend"] == "flashinfer" and kwargs["disable_cuda_graph"] is True


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_sglangs_server_args_take_them():
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="/models/tiny", **KERNEL_FREE_ARGS)
    assert args.attention_backend == "triton"
