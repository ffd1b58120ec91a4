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

from tests.harness.ranks import spawn
from tests.harness.routing import check_results, replay_worker

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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replayed_routing_reaches_every_token(layout, tiny_model, tmp_path):
    path = str(tiny_model("qwen3_moe"))
    results = spawn(replay_worker, 4, tmp_path, path, LAYOUTS[layout])
    assert check_results(results, layout) == {"train", "logp"}


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
