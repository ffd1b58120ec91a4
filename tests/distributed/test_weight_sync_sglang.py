"""Weight sync into a real SGLang engine: what the engine serves equals what the trainer holds.

Contract: after one real optimizer step of the train role (TP=2, and PP=2), `sync_weights`
gathers the sharded model, sends it to the generate rank (TP=2: broadcast transport; PP=2:
shared-memory transport, both senders) and loads it through SGLang's own weight-update API;
every tensor read back from the engine (`get_weights_by_name`, SGLang's own read path) is
bit-identical to the trainer's gathered HF-named tensor, the engine reports the new version on
the tokens it generates next, and the logp role (on the train ranks) holds the same weights.
Nothing is faked: megatron-core on gloo ranks, the real SGLang engine on CPU.
"""

import importlib.util

import pytest
import torch

from tests.distributed.harness import spawn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]


def _worker(rank, world_size, tmp_dir, path, parallel, transport):
    import torch.distributed as dist

    from megatron_async_rl.config.schema import RoleGroupSpec
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
    from megatron_async_rl.engines.sglang_engine import SGLangEngine, SGLangEngineConfig
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from megatron_async_rl.weight_sync.broadcast import sync_weights
    from megatron_async_rl.weight_sync.config import WeightSyncConfig
    from tests.distributed.test_hf_parity import _role_args

    args = _role_args(path, **parallel)
    args.update(lr=1e-2, clip_grad=0.0)
    par = Parallelism.from_megatron_args(args)
    specs = [RoleGroupSpec(["train", "logp"], num_ranks=2), RoleGroupSpec(["generate"], 1)]
    layout = plan_layout(world_size, specs, {"train": par, "logp": par})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    roles, engine = {}, None
    if rank < 2:
        for name in ("train", "logp"):
            roles[name] = MegatronRole(name, args, par, groups.roles[name], platform, seed=5)
            roles[name].load_hf_checkpoint(path)
        tokens = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
        micro = [{"tokens": tokens}]
        roles["train"].train_step(micro, lambda logp, ent, mb: (-logp.mean(), {}))
    else:
        config = SGLangEngineConfig(model_path=path, dtype="float32", max_total_tokens=4096)
        engine = SGLangEngine(config, rank_in_role=0, global_rank=rank)
    dist.barrier()
    metrics = sync_weights(groups, roles, engine, 1, WeightSyncConfig(transport=transport))
    out = {"metrics": metrics}
    if "train" in roles:
        trainer = roles["train"].gather_hf_state_dict()
        logp = roles["logp"].gather_hf_state_dict()
        if trainer is not None:
            out.update(trainer=trainer, logp=logp)
    if engine is not None:
        try:
            out["engine"] = {name: engine.get_weights_by_name(name) for name in _NAMES}
            sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
            result = engine.generate([GenerateRequest([1, 2, 3], sampling, "after-sync")])[0]
            out["versions"] = result.token_versions
        finally:
            engine.shutdown()
    return out


_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from megatron_async_rl.models.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("m") / "llama", "llama", seed=2))


@pytest.mark.parametrize(
    "parallel,transport,shared_senders",
    [
        ({"tensor_model_parallel_size": 2}, "broadcast", 0),
        ({"pipeline_model_parallel_size": 2}, "auto", 2),
    ],
    ids=["train_tp2_broadcast", "train_pp2_shared_memory"],
)
def test_engine_weights_are_the_trainers_bit_for_bit(
    parallel, transport, shared_senders, tiny_path, tmp_path
):
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    results = spawn(_worker, 3, tmp_path, tiny_path, parallel, transport)
    # On one host, "auto" has every sender's receivers read its slots in shared memory.
    for result in results:
        assert result["metrics"]["weight_sync/shared_memory_senders"] == shared_senders
        assert result["metrics"]["weight_sync/device_bridge"] == 0.0  # CPU: the host bridge
    trainer = next(r["trainer"] for r in results if "trainer" in r)
    logp = next(r["logp"] for r in results if "logp" in r)
    engine = next(r["engine"] for r in results if "engine" in r)
    start = load_hf_state_dict(tiny_path)
    assert not trainer["model.layers.0.mlp.up_proj.weight"].equal(
        start["model.layers.0.mlp.up_proj.weight"]
    ), "the train step did not change the weights: the check would be vacuous"
    for name in _NAMES:
        ours, served = trainer[name], engine[name]
        rows = ours.shape[0]
        # SGLang pads the vocab rows of embed/lm_head to a multiple of 64 with zeros.
        assert torch.equal(served[:rows].to(ours.dtype), ours), name
        assert not served[rows:].any(), name
    for name, tensor in trainer.items():
        assert torch.equal(logp[name], tensor), name
    versions = next(r["versions"] for r in results if "versions" in r)
    assert versions and set(versions) == {"v1"}, versions
