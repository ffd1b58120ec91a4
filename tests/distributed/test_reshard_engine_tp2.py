"""The planned reshard into a real SGLang engine of tensor-parallel size 2.

Contracts (megatron-core on gloo ranks, the real SGLang engine started with `tp_size=2` on CPU,
which shards each full HF tensor itself; nothing is faked). Each model runs in one spawned world
whose engine starts once and serves its layouts in turn (`reshard_world.py`: 4 train slots + 1
generate rank; ranks a layout leaves idle hold `ref`):
- dense llama, train TP=2 and PP=2 (2 train ranks) and TP=2 x PP=2 (4 train ranks), plus one
  generate rank: after one real optimizer step, `sync_weights` streams the model in small
  buckets into the engine; every HF tensor read back through the engine (each TP rank's
  parameters, reassembled: see `engines/sglang/host.py`) is bit-identical to the trainer's
  gathered tensor, and the tokens the engine generates next carry the new version.
- MoE (qwen3_moe) train EP=2 and TP=2 x EP=2: the host's read-back reassembles Llama-family
  layouts only, not SGLang's fused expert tensors, so the check is behavioural and exact, as
  with engine TP=1 (`reshard_world.check_moe`): greedy token ids and log-probs after the sync,
  all stamped with the new version, equal those of the same engine after loading the trainer's
  gathered HF state dict as whole tensors, and differ from those before the sync. MoE with
  train TP>1 cannot train on CPU here (Megatron needs sequence parallel, which the local spec's
  torch RMSNorm refuses), so TP=2 x EP=2 changes the weights by one element-wise update applied
  to every shard and replica alike (`_perturb`) instead of an optimizer step.
The engine TP=1 twin is `test_reshard_sglang.py`.

Assertion mapping (before -> here): `test_engine_tp2_serves_the_trainers_weights_bit_for_bit
[train_tp2, train_pp2, train_tp2_pp2]` keeps its name and IDs: q_proj changed by the step
(`check_changed`, which now also checks up_proj and that the engine served other weights before
the sync), `check_served` (was `_check_served`), versions == {v1} (relative: layout i syncs
10i+1). `test_engine_tp2_moe_computes_with_the_trainers_weights[train_ep2, train_tp2_ep2]`:
same name and IDs, `check_moe` (was `_check_moe`).
"""

import importlib.util

import pytest

from tests.distributed.reshard_world import (
    MOE,
    PP2,
    TP2,
    Layout,
    check_changed,
    check_moe,
    check_served,
    label,
    layout_results,
    run_world,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]
ENGINE_TP_SIZE = 2
DENSE = [
    Layout("train_tp2", TP2, 2, "dense", roles=("train",)),
    Layout("train_pp2", PP2, 2, "dense", roles=("train",)),
    Layout("train_tp2_pp2", TP2 | PP2, 4, "dense", roles=("train",)),
]


@pytest.fixture(scope="module")
def llama_path(tiny_model):
    return str(tiny_model("llama"))


@pytest.fixture(scope="module")
def dense_world(llama_path, tmp_path_factory):
    return run_world(llama_path, ENGINE_TP_SIZE, DENSE, tmp_path_factory.mktemp("dense_world"))


@pytest.fixture(scope="module")
def moe_world(tiny_model, tmp_path_factory):
    path = tiny_model("qwen3_moe")
    return run_world(path, ENGINE_TP_SIZE, MOE, tmp_path_factory.mktemp("moe_world"))


@pytest.mark.parametrize("layout", DENSE, ids=[layout.name for layout in DENSE])
def test_engine_tp2_serves_the_trainers_weights_bit_for_bit(layout, dense_world, llama_path):
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    results = layout_results(dense_world, layout.name)
    assert [r["rank"] for r in results] == [*range(layout.num_train), 4]
    trainer = next(r["trainer_v1"] for r in results if "trainer_v1" in r)
    engine, versions = next(r["engine_v1"] for r in results if "engine_v1" in r)
    start = load_hf_state_dict(llama_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not trainer[name].equal(start[name]), "the step changed nothing: vacuous check"
    check_changed(results, start)
    check_served(engine, trainer)
    assert versions and set(versions) == {label(results, 1)}


@pytest.mark.parametrize("layout", MOE, ids=[layout.name for layout in MOE])
def test_engine_tp2_moe_computes_with_the_trainers_weights(layout, moe_world):
    check_moe(layout_results(moe_world, layout.name))
