"""Why the CUDA graph flags configure nothing here (config/megatron/inventory.py `_GRAPHS`), checked
against the installed megatron-core rather than taken on trust; no GPU is needed, since each
check stops before the first capture.

Contract, with megatron-core's global parallel state uninitialised (as in every role here):
- per-layer graphs (`--cuda-graph-impl local`): building a graphed `TransformerLayer` *given an
  explicit `pg_collection`* still fails with megatron-core's "... is not initialized"
  AssertionError, raised under `CudaGraphManager.__init__`: 0.16.1 reads the global pipeline
  group there (cuda_graphs.py:1429); 0.19.2's manager takes a `pg_collection` and honours one,
  but no module that builds a manager passes it, so it reads every global group
  (`ProcessGroupCollection.use_mpu_process_groups`, cuda_graphs.py:1793);
- Transformer Engine graphs (`--cuda-graph-impl transformer_engine`): 0.19.2's
  `TECudaGraphHelper` takes the role's groups, but is driven by a training loop (capture after
  the warm-up, manual parameter hooks) and reads the global micro-batch calculator; 0.16.1's
  takes no groups;
- full-iteration graphs barrier the whole world (`torch.distributed.barrier()` with no group),
  which here also holds the engine ranks.
Faked: in the first test only, the two CUDA-only checks 0.16.1's manager makes before it reads
a group (the device capability and the graph-safe RNG tracker). If an upgrade changes any of
these, a test here fails: revisit the refusal.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import traceback
import types
from pathlib import Path

import pytest
import torch
from packaging.version import Version

MEGATRON_CORE = Version(importlib.metadata.version("megatron-core"))
ON_0_16 = pytest.mark.skipif(
    MEGATRON_CORE.release[:2] != (0, 16),
    reason=f"pins megatron-core 0.16.x; {MEGATRON_CORE} is installed",
)
ON_0_19 = pytest.mark.skipif(
    MEGATRON_CORE.release[:2] != (0, 19),
    reason=f"pins megatron-core 0.19.x; {MEGATRON_CORE} is installed",
)
KNOWN = pytest.mark.skipif(
    MEGATRON_CORE.release[:2] not in ((0, 16), (0, 19)),
    reason=f"measured on megatron-core 0.16.x and 0.19.x; {MEGATRON_CORE} is installed",
)
GLOBAL_READER = {
    (0, 16): ("parallel_state.py", "get_pipeline_model_parallel_world_size"),
    (0, 19): ("process_groups_config.py", "use_mpu_process_groups"),
}
"""The call under `CudaGraphManager.__init__` that reads the global groups, per release."""


def _graphed_config(impl: str = "local"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                             cuda_graph_impl=impl)  # fmt: skip


@pytest.fixture
def no_global_state():
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()


@KNOWN
def test_a_graphed_layer_given_its_groups_reads_the_global_state(no_global_state, monkeypatch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.transformer_layer import TransformerLayer

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    graph_safe = types.SimpleNamespace(is_inference_rng_tracker=True)
    monkeypatch.setattr(cuda_graphs, "get_cuda_rng_tracker", lambda: graph_safe)
    submodules = get_gpt_layer_local_spec().submodules
    with pytest.raises(AssertionError, match="is not initialized") as raised:
        TransformerLayer(_graphed_config(), submodules, pg_collection=ProcessGroupCollection())
    frames = [(Path(f.filename).name, f.name) for f in traceback.extract_tb(raised.tb)]
    manager = frames.index(("cuda_graphs.py", "__init__"))
    assert GLOBAL_READER[MEGATRON_CORE.release[:2]] in frames[manager:], frames


def _manager_calls() -> list[tuple[str, bool]]:
    """Every `CudaGraphManager(...)` in megatron-core: (file:line, passes a pg_collection)."""
    import megatron.core

    root = Path(megatron.core.__file__).parent
    calls = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if "CudaGraphManager(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "CudaGraphManager"
            ):
                passes = len(node.args) >= 5 or any(k.arg == "pg_collection" for k in node.keywords)
                calls.append((f"{path.relative_to(root)}:{node.lineno}", passes))
    return calls


@KNOWN
def test_no_module_gives_its_graph_manager_a_group():
    calls = _manager_calls()
    assert len(calls) >= 5, calls  # layers, MoE, Mamba, MTP: 9 sites in 0.16.1, 10 in 0.19.2
    assert not [site for site, passes in calls if passes], "revisit the refusal"


@ON_0_16
def test_the_0_16_graph_manager_takes_no_group():
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, TECudaGraphHelper

    assert "pg_collection" not in inspect.signature(CudaGraphManager).parameters
    assert "pg_collection" not in inspect.signature(TECudaGraphHelper).parameters


@ON_0_19
def test_the_0_19_graph_manager_honours_a_group_it_is_given(no_global_state):
    """Past the groups it stops at the first CUDA-only check (the graph-safe RNG tracker)."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager

    pipeline = types.SimpleNamespace(size=lambda: 1)
    with pytest.raises(AssertionError, match="RNG tracker does not support cudagraphs"):
        CudaGraphManager(_graphed_config(), pg_collection=types.SimpleNamespace(pp=pipeline))


@ON_0_19
def test_the_0_19_engine_graph_helper_takes_groups_and_reads_the_global_batch_calculator():
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    assert "pg_collection" in inspect.signature(TECudaGraphHelper).parameters
    assert "get_num_microbatches()" in inspect.getsource(TECudaGraphHelper)


@KNOWN
def test_full_iteration_graphs_barrier_the_whole_world():
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    source = inspect.getsource(FullCudaGraphWrapper.__call__)
    assert source.count("torch.distributed.barrier()") == 2, "revisit the refusal"
