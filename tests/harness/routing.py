"""MoE routing replay checks run inside a rank: record, replay, perturb, replay again, and an
optimizer step replaying with full recompute; and the checks of their results.

The contracts are `tests/distributed/test_routing_replay.py`'s (its docstring); also run with
two virtual pipeline stages (`tests/distributed/test_virtual_pipeline.py`) and on a GPU
(`tests/gpu/test_routing_replay_cuda.py`).
"""

from __future__ import annotations

import torch

from tests.harness.parity import parity_tokens
from tests.harness.roles import role_args

RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1}  # fmt: skip


def _perturb_routers(module, scale: float = 0.8) -> None:
    """Noise on every router's gate weight, the same on every rank (replicated weights)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if name.endswith("router.weight"):
                noise = torch.randn(param.shape, generator=generator).to(param.device)
                param.add_((noise * param.std() * scale).to(param.dtype))


def replay_worker(rank, world_size, tmp_dir, path, role_parallel):
    """[train (ranks 0-1), logp (ranks 2-3)] with `role_parallel`, MoE routing on: this
    rank's `replay_checks`."""
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole

    args = {role: role_args(path, **par) for role, par in role_parallel.items()}
    args["train"].update(RECOMPUTE)
    layout = plan_layout(
        world_size,
        [RoleGroupSpec(roles=["train"], num_ranks=2), RoleGroupSpec(roles=["logp"], num_ranks=2)],
        {role: Parallelism.from_megatron_args(a) for role, a in args.items()},
    )
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    role = layout.roles_of_rank(rank)[0]
    model = MegatronRole(role, args[role], layout.parallelism[role], groups.roles[role], platform,
                         seed=5, routing=True)  # fmt: skip
    model.load_hf_checkpoint(path)
    return replay_checks(model, role)


def replay_checks(model, role: str) -> dict:
    """Record, replay, perturb, replay again (and for train an optimizer step replaying): the
    role's results for `check_results` (also run on a GPU: tests/gpu)."""
    from megatron_async_rl.moe.replay import gather_recorded

    tokens = parity_tokens(model.spec.vocab_size)
    valid = torch.ones(tokens.shape, dtype=torch.bool)
    routing, pp = model.routing, model.pgc.pp

    def logp(**kw):
        out = model.logprobs(tokens, 2, kw)
        return None if out is None else out[0]

    natural = logp(record=True)
    recorded = gather_recorded(routing, routing.take_recorded(2), pp)
    replayed = logp(replay=recorded, compare=recorded, valid=valid)
    counts_same = routing.take_counts()
    for chunk in model.chunks:  # one, or each virtual pipeline stage's
        _perturb_routers(chunk)
    perturbed = logp(compare=recorded, valid=valid)
    counts_perturbed = routing.take_counts()
    replay_perturbed = logp(replay=recorded, valid=valid, record=True)
    used = gather_recorded(routing, routing.take_recorded(2, used=True), pp)
    result = {
        "role": role, "natural": natural, "replayed": replayed, "perturbed": perturbed,
        "replay_perturbed": replay_perturbed, "recorded": recorded, "used": used,
        "counts_same": counts_same, "counts_perturbed": counts_perturbed,
    }  # fmt: skip
    if role == "train":  # an optimizer step replaying the recording, with full recompute
        seen = []

        def loss_fn(logp_BT, entropy, mb):
            seen.append(logp_BT.detach().clone())
            return logp_BT.sum() * 0.0 + (logp_BT * mb["mask"]).sum() / 100.0, {}

        micro = [
            {"tokens": tokens[i : i + 2], "mask": torch.ones(2, tokens.shape[1] - 1),
             "replay": recorded[i : i + 2], "valid": valid[i : i + 2]}
            for i in range(0, tokens.shape[0], 2)
        ]  # fmt: skip
        model.train_step(micro, loss_fn)
        result["train_logp"] = torch.cat(seen) if seen else None
        result["left_in_backward_queues"] = sum(len(s.backward) for s in routing.slots)
    return result


def check_results(
    results: list[dict], layout: str, atol: float = 1e-5, moe_layers: int = 2
) -> set[str]:
    """The contracts of test_routing_replay.py's docstring over every rank's `replay_checks` (a
    model of `moe_layers` MoE layers); returns the roles whose last stage compared log-probs."""
    compared = set()
    for r in results:
        role = r["role"]
        assert torch.equal(r["used"], r["recorded"]), f"{layout} {role}: replayed != recorded"
        assert r["recorded"].shape == (4, 24, moe_layers, 2)  # B, T, MoE layers, top-k
        for layer, (matched, used, total) in r["counts_same"].items():
            assert total > 0 and matched == used == total, f"{role} {layer}: {matched}/{total}"
        disagree = sum(t - m for m, _, t in r["counts_perturbed"].values())
        assert disagree > 0, f"{layout} {role}: the perturbed routers still agree everywhere"
        if r["natural"] is None:
            continue
        compared.add(role)
        assert torch.equal(r["replayed"], r["natural"]), f"{layout} {role}: replay changed logp"
        assert not torch.equal(r["perturbed"], r["natural"])
        assert not torch.equal(r["replay_perturbed"], r["perturbed"])
        if role == "train":
            torch.testing.assert_close(r["train_logp"], r["replay_perturbed"], rtol=0, atol=atol)
    for r in results:
        if r["role"] == "train":
            assert r["left_in_backward_queues"] == 0, "recompute did not replay every micro-batch"
    return compared
