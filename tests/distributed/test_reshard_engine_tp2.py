"""The planned reshard into a real SGLang engine of tensor-parallel size 2: bit-identical weights.

Contract: after one real optimizer step of the train role (megatron-core on gloo ranks, train
TP=2 or PP=2 over two ranks), `sync_weights` streams the model in small buckets into a real
SGLang engine started with `tp_size=2` on CPU (SGLang shards each full HF tensor itself); every
HF tensor read back through the engine (each TP rank's parameters, reassembled: see
`engines/sglang_host.py`) is bit-identical to the trainer's gathered tensor, and the tokens the
engine generates next carry the new version. The engine TP=1 twin is
`tests/distributed/test_reshard_sglang.py`. Nothing is faked.
"""

import importlib.util

import pytest
import torch

from tests.distributed.harness import spawn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]
PRODUCE_MB, CONSUME_MB = 0.03, 0.01


def _worker(rank, world_size, tmp_dir, path, parallel):
    import torch.distributed as dist

    from megatron_async_rl.config.schema import RoleGroupSpec
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from megatron_async_rl.weight_sync.broadcast import sync_weights
    from megatron_async_rl.weight_sync.config import WeightSyncConfig
    from tests.distributed.test_hf_parity import _role_args
    from tests.distributed.test_reshard_sglang import _greedy, _train_step

    args = _role_args(path, **parallel)
    args.update(lr=1e-2, clip_grad=0.0)
    par = Parallelism.from_megatron_args(args)
    specs = [RoleGroupSpec(["train"], num_ranks=2), RoleGroupSpec(["generate"], 1)]
    layout = plan_layout(world_size, specs, {"train": par})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    roles, engine = {}, None
    if rank < 2:
        roles["train"] = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
        roles["train"].load_hf_checkpoint(path)
    else:
        config = SGLangEngineConfig(
            model_path=path, dtype="float32", max_total_tokens=4096, tp_size=2
        )
        engine = SGLangEngine(config, rank_in_role=0, global_rank=rank)
    dist.barrier()
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
            names = sorted(load_hf_state_dict(path))
            out["engine"] = {n: engine.get_weights_by_name(n) for n in names}
            out["versions"] = _greedy(engine)[2]
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    from megatron_async_rl.models.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=3))


@pytest.mark.parametrize(
    "parallel",
    [{"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}],
    ids=["train_tp2", "train_pp2"],
)
def test_engine_tp2_serves_the_trainers_weights_bit_for_bit(parallel, llama_path, tmp_path):
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    results = spawn(_worker, 3, tmp_path, llama_path, parallel)
    trainer = next(r["trainer"] for r in results if "trainer" in r)
    served = next(r for r in results if "engine" in r)
    start = load_hf_state_dict(llama_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not trainer[name].equal(start[name]), "the step changed nothing: vacuous check"
    assert served["engine"].keys() == trainer.keys()
    for name, ours in trainer.items():
        got = served["engine"][name]
        # SGLang pads embed/lm_head vocab rows with zeros (to a multiple of 64 x TP).
        assert torch.equal(got[: ours.shape[0]].to(ours.dtype), ours), name
        assert not got[ours.shape[0] :].any(), name
    assert served["versions"] and set(served["versions"]) == {"v1"}
