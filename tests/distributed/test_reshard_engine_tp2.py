"""The planned reshard into a real SGLang engine of tensor-parallel size 2.

Contracts (megatron-core on gloo ranks, the real SGLang engine started with `tp_size=2` on CPU,
which shards each full HF tensor itself; nothing is faked):
- dense llama, train TP=2 and PP=2 (2 train ranks) and TP=2 x PP=2 (4 train ranks), plus one
  generate rank: after one real optimizer step, `sync_weights` streams the model in small
  buckets into the engine; every HF tensor read back through the engine (each TP rank's
  parameters, reassembled: see `engines/sglang_host.py`) is bit-identical to the trainer's
  gathered tensor, and the tokens the engine generates next carry `v1`.
- MoE (qwen3_moe) train EP=2 and TP=2 x EP=2: the host's read-back reassembles Llama-family
  layouts only, not SGLang's fused expert tensors, so the check is behavioural and exact, as
  with engine TP=1 (`test_reshard_sglang._moe_worker`): greedy token ids and log-probs after
  the sync, all stamped `v1`, equal those of the same engine after loading the trainer's
  gathered HF state dict as whole tensors, and differ from those before the sync. MoE with
  train TP>1 cannot train on CPU here (Megatron needs sequence parallel, which the local spec's
  torch RMSNorm refuses), so TP=2 x EP=2 changes the weights by one element-wise update applied
  to every shard and replica alike (`_perturb`) instead of an optimizer step.
The engine TP=1 twins are `test_reshard_sglang.py` and `test_weight_sync_sglang.py`.
"""

import importlib.util

import pytest

from tests.distributed.harness import spawn
from tests.distributed.test_reshard_sglang import (
    CONSUME_MB,
    MOE_LAYOUTS,
    PRODUCE_MB,
    _check_moe,
    _check_served,
    _dense_names,
    _greedy,
    _moe_worker,
    _setup,
    _train_step,
    tiny_model,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]
ENGINE_TP_SIZE = 2


def _worker(rank, world_size, tmp_dir, path, parallel):
    from megatron_async_rl.weight_sync.broadcast import sync_weights
    from megatron_async_rl.weight_sync.config import WeightSyncConfig

    groups, roles, engine = _setup(
        rank, world_size, path, parallel, world_size - 1, ENGINE_TP_SIZE, ("train",)
    )
    out = {"rank": rank}
    try:
        _train_step(roles, seed=0)
        config = WeightSyncConfig(produce_bucket_mb=PRODUCE_MB, consume_bucket_mb=CONSUME_MB)
        sync_weights(groups, roles, engine, version=1, config=config)
        if "train" in roles:
            trainer = roles["train"].gather_hf_state_dict()
            if trainer is not None:
                out["trainer"] = trainer
        if engine is not None:
            out["engine"] = {n: engine.get_weights_by_name(n) for n in _dense_names(path)}
            out["versions"] = _greedy(engine)[2]
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return tiny_model(tmp_path_factory, "llama", seed=3)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return tiny_model(tmp_path_factory, "qwen3_moe", seed=3)


@pytest.mark.parametrize(
    "parallel,num_train",
    [
        ({"tensor_model_parallel_size": 2}, 2),
        ({"pipeline_model_parallel_size": 2}, 2),
        ({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, 4),
    ],
    ids=["train_tp2", "train_pp2", "train_tp2_pp2"],
)
def test_engine_tp2_serves_the_trainers_weights_bit_for_bit(
    parallel, num_train, llama_path, tmp_path
):
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    results = spawn(_worker, num_train + 1, tmp_path, llama_path, parallel)
    trainer = next(r["trainer"] for r in results if "trainer" in r)
    served = next(r for r in results if "engine" in r)
    start = load_hf_state_dict(llama_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not trainer[name].equal(start[name]), "the step changed nothing: vacuous check"
    _check_served(served["engine"], trainer)
    assert served["versions"] and set(served["versions"]) == {"v1"}


@MOE_LAYOUTS
def test_engine_tp2_moe_computes_with_the_trainers_weights(parallel, num_train, moe_path, tmp_path):
    _check_moe(
        spawn(_moe_worker, num_train + 1, tmp_path, moe_path, parallel, num_train, ENGINE_TP_SIZE)
    )
