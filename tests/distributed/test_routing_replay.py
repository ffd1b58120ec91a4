"""MoE routing replay in real Megatron roles (gloo, 4 CPU ranks), token by token.

Contracts, for a tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2) under train and logp layouts
of EP=2 and PP=2 (TP=1), micro-batches of 2 samples:
- replaying the routing a pass recorded gives that pass's log-probs exactly (the replayed ids
  reach the right router, layer and token);
- after the routers are perturbed, their own top-k disagrees with the recording on some tokens
  (counted by the agreement metric), and a replaying pass uses the recorded experts on every
  token (`used` equals the recording, gathered over TP, PP and micro-batches);
- the train role's optimizer step replays too: its forward log-probs equal the replaying
  forward-only pass, and with full activation recompute the backward pass consumes every
  replayed micro-batch (`moe.replay.RouterSlot`'s first-in-first-out queue empties).
Nothing is faked. MoE with TP > 1 needs sequence parallelism, which megatron-core builds only
with Transformer Engine's norms (none on CPU): the sequence-parallel token split is checked on
its own in `test_sequence_parallel_split_and_gather`, against the layout megatron-core uses.
"""

import pytest
import torch

from tests.distributed.harness import spawn
from tests.distributed.test_hf_parity import _role_args, _tokens

LAYOUTS = {
    "train-ep2-logp-pp2": {
        "train": {"expert_model_parallel_size": 2},
        "logp": {"pipeline_model_parallel_size": 2},
    },
    "train-pp2-logp-ep2": {
        "train": {"pipeline_model_parallel_size": 2},
        "logp": {"expert_model_parallel_size": 2},
    },
}
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


def _worker(rank, world_size, tmp_dir, path, role_parallel):
    from megatron_async_rl.config.schema import RoleGroupSpec
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.roles.megatron_role import MegatronRole

    args = {role: _role_args(path, **par) for role, par in role_parallel.items()}
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

    tokens = _tokens(model.spec.vocab_size)
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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replayed_routing_reaches_every_token(layout, tiny_model, tmp_path):
    path = str(tiny_model("qwen3_moe"))
    results = spawn(_worker, 4, tmp_path, path, LAYOUTS[layout])
    assert check_results(results, layout) == {"train", "logp"}


def check_results(
    results: list[dict], layout: str, atol: float = 1e-5, moe_layers: int = 2
) -> set[str]:
    """The contracts of the module docstring over every rank's `replay_checks` (a model of
    `moe_layers` MoE layers); returns the roles whose last stage compared log-probs."""
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


def _sp_worker(rank, world_size, tmp_dir):
    """RoleRouting's sequence-parallel split and gather on a 2-rank TP group (routers driven
    directly with the tokens a TP rank's router sees: its S / 2 positions, s-major)."""
    import types

    import torch.distributed as dist

    from megatron_async_rl.moe.replay import RoleRouting, gather_recorded

    group = dist.new_group([0, 1])
    ns = types.SimpleNamespace
    layers = [ns(layer_number=n, mlp=ns(router=ns())) for n in (1, 2)]
    module = types.SimpleNamespace(decoder=types.SimpleNamespace(layers=layers))
    routing = RoleRouting(module, [0, 1], group, sequence_parallel=True)
    g = torch.Generator().manual_seed(3)
    target = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(4 * 6 * 2)])
    target = target.view(4, 6, 2, 2)  # B=4, S=6, L=2, K=2
    scores = torch.rand(3 * 2, 8, generator=g)  # this rank's 3 positions x 2 samples
    for i in (0, 2):  # micro-batches of 2 samples
        routing.micro_batch(replay_bSLK=target[i : i + 2], record=True)
        for slot in routing.slots:
            slot.get_replay_topk(scores, 2, None, None, lambda s, k, *_: torch.topk(s, k, dim=1))
    gathered = gather_recorded(routing, routing.take_recorded(2, used=True), dist.group.WORLD)
    return {"equal": torch.equal(gathered, target), "shape": tuple(gathered.shape)}


def test_sequence_parallel_split_and_gather(tmp_path):
    results = spawn(_sp_worker, 2, tmp_path)
    assert all(r["equal"] for r in results), results
