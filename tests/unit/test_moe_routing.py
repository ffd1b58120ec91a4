"""Routed experts as data, the replay slot's rules, and the `moe:` recipe section.

Contracts: SGLang's payload (base64 int32 [rows, layers, k]) decodes to the MoE layers' rows in
the narrowest dtype, and a payload of another model is refused; the batch layout puts row t of
a sample at position t, marks the rows the engine routed, and refuses a shape that does not
match the sample; top-k agreement ignores order; a `RouterSlot` routes on its own, replays
(keeping its own choice where the engine did not route), counts agreement, records, and in a
backward pass replays its forward's experts first in first out; the recipe refuses routing
replay on a dense model and takes `--moe-enable-routing-replay` as `moe.routing_replay: r3`.
The megatron-core parts run for real in tests/distributed/test_routing_replay.py.
"""

import base64
import dataclasses

import numpy as np
import pytest
import torch

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.moe.config import MoEConfig
from megatron_async_rl.moe.routing import (
    agreement_metrics,
    compact_dtype,
    decode_engine_routing,
    routing_batch,
    routing_bytes_per_token,
    routing_counts,
    same_topk_set,
)


def test_compact_dtype_is_the_narrowest_that_holds_every_expert():
    assert compact_dtype(4) == torch.uint8
    assert compact_dtype(256) == torch.uint8
    assert compact_dtype(257) == torch.int16
    assert routing_bytes_per_token(48, 8, 128) == 384  # Qwen3-30B-A3B: 48 layers, top-8
    assert routing_bytes_per_token(58, 8, 257) == 928


def test_engine_payload_keeps_the_moe_layers_in_order():
    ids = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2) % 7
    payload = base64.b64encode(ids.tobytes()).decode()
    got = decode_engine_routing(payload, num_layers=3, topk=2, layers=(1, 2), num_experts=8)
    assert got.dtype == torch.uint8 and got.shape == (5, 2, 2)
    assert torch.equal(got, torch.from_numpy(ids[:, 1:3].astype(np.uint8)))
    same = decode_engine_routing(ids, num_layers=3, topk=2, layers=(1, 2), num_experts=8)
    assert torch.equal(same, got)


def test_engine_payload_of_another_model_is_refused():
    ids = np.zeros((5, 3, 2), dtype=np.int32)
    with pytest.raises(ValueError, match="do not split into rows of 4 layers x 2"):
        decode_engine_routing(ids, num_layers=4, topk=2, layers=(0,), num_experts=8)
    ids[2, 1, 0] = 9
    with pytest.raises(ValueError, match=r"ids in \[0, 9\] outside \[0, 8\)"):
        decode_engine_routing(ids, num_layers=3, topk=2, layers=(0, 1), num_experts=8)


@dataclasses.dataclass
class _Sample:
    uid: str
    prompt_ids: list
    response_ids: list
    routed_experts: object = None


def _routed(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(rows * 3)]).view(
        rows, 3, 2).to(torch.uint8)  # fmt: skip


def test_batch_layout_puts_row_t_at_position_t_and_marks_what_the_engine_routed():
    a = _Sample("a", [1, 2, 3], [4, 5], _routed(4, 0))  # 3 + 2 - 1 rows
    b = _Sample("b", [1], [4, 5, 6, 7], _routed(4, 1))
    c = _Sample("c", [1, 2], [9], None)  # a continued response whose engine died: no routing
    routing, valid = routing_batch([a, b, c], seq_len=8, num_layers=3, topk=2)
    assert routing.shape == (3, 8, 3, 2) and routing.dtype == torch.uint8
    assert torch.equal(routing[0, :4], a.routed_experts)
    assert torch.equal(routing[1, :4], b.routed_experts)
    assert valid.tolist() == [[True] * 4 + [False] * 4, [True] * 4 + [False] * 4, [False] * 8]
    assert torch.equal(routing[2], torch.tensor([0, 1], dtype=torch.uint8).expand(8, 3, 2))
    assert routing_batch([c], 8, 3, 2) == (None, None)


def test_batch_layout_refuses_a_sample_whose_rows_do_not_match_its_tokens():
    bad = _Sample("bad", [1, 2, 3], [4, 5], _routed(5, 0))
    with pytest.raises(ValueError, match=r"sample bad: routed experts of shape \(5, 3, 2\), "
                       r"expected \(4, 3, 2\)"):  # fmt: skip
        routing_batch([bad], 8, 3, 2)


def test_topk_agreement_ignores_order():
    a = torch.tensor([[0, 1], [2, 3], [1, 3]])
    b = torch.tensor([[1, 0], [2, 1], [3, 1]], dtype=torch.uint8)
    assert same_topk_set(a, b).tolist() == [True, False, True]


def test_agreement_metrics_from_summed_counts():
    sums = {}
    for part in ({0: (3, 4, 4), 1: (1, 4, 4)}, {0: (4, 4, 4), 1: (2, 3, 4)}):  # two ranks
        for key, value in routing_counts(part).items():
            sums[key] = sums.get(key, 0.0) + value
    got = agreement_metrics(sums)
    assert got["moe/routing_agreement/layer_0"] == 7 / 8
    assert got["moe/routing_agreement/layer_1"] == 3 / 8
    assert got["moe/routing_agreement"] == pytest.approx((7 / 8 + 3 / 8) / 2)
    assert got["moe/replay_agreement"] == pytest.approx((8 / 8 + 7 / 8) / 2)
    assert got["moe/routing_tokens"] == 8
    assert agreement_metrics({}) == {}


def test_moe_section_checks():
    assert MoEConfig().routing_replay == "off" and MoEConfig().engine_routing
    assert MoEConfig(routing_replay="R3").routing_replay == "r3"
    assert MoEConfig(routing_replay=False).routing_replay == "off"  # YAML's bare `off`
    assert not MoEConfig(routing_metrics=False).engine_routing
    assert MoEConfig(routing_replay="r3", routing_metrics=False).engine_routing
    with pytest.raises(ConfigError, match="routing_replay = 'r4': must be one of off, r2, r3"):
        MoEConfig(routing_replay="r4")
    with pytest.raises(ConfigError, match="routing_metrics = 'yes': must be true or false"):
        MoEConfig(routing_metrics="yes")


# -- the replay slot (megatron-core's RouterReplay hook), driven directly -----------------------


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def _slot():
    from megatron_async_rl.moe.replay import RouterReplay, RouterSlot

    slot = RouterSlot(0)
    assert slot not in RouterReplay.global_router_replay_instances  # roles drive their own
    return slot


def test_slot_replays_counts_and_keeps_its_own_choice_where_the_engine_did_not_route():
    slot = _slot()
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.0, 0.1, 0.8, 0.9], [0.5, 0.0, 0.4, 0.3]])
    probs, idx = slot.get_replay_topk(scores, 2, None, None, _topk)  # nothing set: its own
    assert idx.tolist() == [[0, 1], [3, 2], [0, 2]]
    slot.replay_NK = torch.tensor([[2, 3], [0, 1], [1, 3]])
    slot.compare_NK = slot.replay_NK
    slot.valid_N = torch.tensor([True, True, False])
    slot.record = True
    probs, idx = slot.get_replay_topk(scores, 2, None, None, _topk)
    assert idx.tolist() == [[2, 3], [0, 1], [0, 2]]  # the third token keeps its own
    assert torch.equal(probs, scores.gather(1, idx))
    # own vs engine and used vs engine, on the valid tokens only
    assert (int(slot.matched), int(slot.used_matched), int(slot.total)) == (0, 2, 2)
    assert slot.recorded[0].tolist() == [[0, 1], [3, 2], [0, 2]]
    assert slot.used[0].tolist() == [[2, 3], [0, 1], [0, 2]]


def test_slot_replays_in_a_recomputed_forward_what_its_forward_used():
    slot = _slot()
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0]], requires_grad=True)
    slot.keep_for_backward = True
    seen = []
    for replay in ([[2, 3]], [[1, 2]]):  # two micro-batches, forwards first
        slot.replay_NK = torch.tensor(replay)
        slot.get_replay_topk(scores.detach(), 2, None, None, _topk)

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            seen.append(slot.get_replay_topk(scores.detach(), 2, None, None, _topk)[1].tolist())
            return grad

    Recompute.apply(scores).sum().backward()
    Recompute.apply(scores).sum().backward()
    assert seen == [[[2, 3]], [[1, 2]]]  # first in, first out, inside autograd's backward
    with pytest.raises(RuntimeError, match="found no replayed experts kept for it"):
        Recompute.apply(scores).sum().backward()
