"""One train step gives the same new weights whatever the train role's layout.

Contract: `MegatronRole.train_step` with a loss normalised over the whole step (global token
count) produces, after one Adam step from the same HF checkpoint on the same batch, weights that
agree within 1e-6 across TP=1, TP=2, PP=2 and DP=2 (each DP rank trains on half the batch), and
that differ from the starting weights. This pins the gradient-accumulation and data-parallel
scaling in `train_step`. Nothing is faked: real megatron-core on gloo ranks.
"""

import pytest
import torch

from tests.distributed.harness import spawn

LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "dp2": (2, {}),
}


def _batch():
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 96, (4, 12), generator=generator)
    mask = torch.zeros(4, 11)
    mask[:, 5:] = 1.0
    mask[1, 9:] = 0.0  # ragged response lengths
    return tokens, mask


def _worker(rank, world_size, tmp_dir, path, parallel):
    from megatron_async_rl.config.schema import RoleGroupSpec
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.distributed.test_hf_parity import _role_args

    args = _role_args(path, **parallel)
    args.update(lr=1e-3, clip_grad=0.0)
    par = Parallelism.from_megatron_args(args)
    groups_spec = [RoleGroupSpec(["train"], num_ranks=world_size)]
    layout = plan_layout(world_size, groups_spec, {"train": par})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
    role.load_hf_checkpoint(path)
    tokens, mask = _batch()
    total_tokens = mask.sum()
    dp_rank = torch.distributed.get_rank(role.pgc.dp)
    dp_size = torch.distributed.get_world_size(role.pgc.dp)
    rows = torch.arange(4).chunk(dp_size)[dp_rank]
    micro = [{"tokens": tokens[r : r + 1], "mask": mask[r : r + 1]} for r in rows.tolist()]

    def loss_fn(logp, entropy, batch):
        loss = -(logp * batch["mask"]).sum() / total_tokens
        return loss, {"loss": loss.detach()}

    metrics = role.train_step(micro, loss_fn)
    return {"weights": role.gather_hf_state_dict(), "metrics": metrics}


@pytest.fixture(scope="module")
def tiny_path(tiny_model):
    return str(tiny_model("llama"))


def test_layouts_agree_after_one_step(tiny_path, tmp_path):
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    start = load_hf_state_dict(tiny_path)
    weights = {}
    for name, (world, parallel) in LAYOUTS.items():
        (tmp_path / name).mkdir()
        results = spawn(_worker, world, tmp_path / name, tiny_path, parallel)
        weights[name] = next(r["weights"] for r in results if r["weights"] is not None)
        grad_norms = {round(r["metrics"]["actor/grad_norm"], 5) for r in results}
        assert len(grad_norms) == 1 and grad_norms.pop() > 0, (name, grad_norms)
    reference = weights["tp1"]
    assert any(not reference[k].equal(start[k]) for k in start)
    for name, got in weights.items():
        for key, tensor in reference.items():
            diff = (got[key] - tensor).abs().max().item()
            assert diff <= 1e-6, f"{name} {key}: max abs diff {diff} vs tp1"
