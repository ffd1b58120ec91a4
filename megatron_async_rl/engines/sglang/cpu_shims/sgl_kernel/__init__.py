"""CPU stand-in for `sgl_kernel`, imported by SGLang's CPU engine (see ../README.md).

With `SGLANG_USE_CPU_ENGINE=1`, a few SGLang modules import CPU helpers from `sgl_kernel` at
module level. The PyPI `sglang-kernel` wheel is CUDA-only and SGLang's own CPU build is not
published, so this module provides the one helper the ordinary decode path calls,
`assign_req_to_token_pool_cpu`, in plain torch, and the other imported names as functions that
raise: they belong to features (speculative decoding, KV-cache moves between layers) that the
engines here never enable. It registers no `torch.ops.sgl_kernel` ops, so SGLang's check for
the Intel AMX kernels fails and it picks its torch-native layers even on an AMX CPU.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+megatron_async_rl.cpu_shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the req-to-token table.

    Request `i` owns row `req_to_token[req_pool_indices[i]]`; its slots for positions
    `start_offset[i]:end_offset[i]` are the next `end - start` entries of `out_cache_loc`,
    which holds all requests' new slots back to back in batch order.
    """
    del pool_len  # the row length; torch indexing knows it
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        num_new = end - start
        if num_new <= 0:
            continue
        req_to_token[row, start:end] = out_cache_loc[offset : offset + num_new].to(
            req_to_token.dtype
        )
        offset += num_new


def _unsupported(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not provided by the megatron_async_rl CPU shim; it serves "
            "features the CPU engine here does not enable (speculative decoding, KV offload)"
        )

    kernel.__name__ = name
    return kernel


# Imported at module level by SGLang when the CPU engine flag is set; never called on the
# paths this project uses.
for _name in (
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
):
    globals()[_name] = _unsupported(_name)
del _name
