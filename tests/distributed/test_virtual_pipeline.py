"""Virtual (interleaved) pipeline stages: two model chunks per pipeline rank, as one chunk does.

Contract, on a 4-layer tiny Llama over pp = 2 gloo ranks with V = 2 chunks per rank
(--num-virtual-stages-per-pipeline-rank 2: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3),
real megatron-core and its interleaved schedule, nothing faked:
- log-probs through the interleaved schedule equal `transformers`' (1e-4) and pp = 2 with one
  chunk per rank (1e-5); the gathered HF state dict is the checkpoint, byte for byte, every HF
  name once;
- weight sync from a V = 2 train role (each pipeline rank's sender sends both its chunks) into
  a V = 1 logp role leaves the logp role's weights equal to the train role's, bit for bit;
- one optimizer step at pp = 2, V = 2 (tied embeddings: the last chunk's output layer copy),
  also x DP = 2 with the distributed optimizer and overlapped grad reduce, gives the weights of
  the same step at pp = 1 within 1e-6;
- a checkpoint saved at V = 2 loads back at V = 2 (then the next step equals the uninterrupted
  run bit for bit) and at pp = 2 with one chunk per rank (the same weights);
- MoE routing replay reaches every chunk's routers (a 4-layer tiny Qwen3-MoE);
- a critic's value head and a reward model's score head give `transformers`' outputs.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import heads
from tests.harness.ranks import spawn
from tests.harness.roles import one_window_roles, role_args
from tests.harness.routing import check_results, replay_worker
from tests.harness.train_steps import seeded_step, train_step_worker

VP = {"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2}
PP = {"pipeline_model_parallel_size": 2}


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))


def _forward_and_sync_worker(rank, world_size, tmp_dir, path):
    """train (V = 2), logp (V = 1) and ref (V = 2) on both ranks: log-probs, exports, a sync."""
    from megatron_async_rl.weight_sync.broadcast import sync_weights

    roles, groups = one_window_roles("train", world_size, path, None,
                          windows={"train": VP, "logp": PP, "ref": VP})  # fmt: skip
    tokens = _tokens(roles["ref"].spec.vocab_size)
    out = {
        "chunks": [len(roles[r].chunks) for r in ("train", "logp", "ref")],
        "logp_v2": roles["ref"].logprobs(tokens, micro_batch_size=2),
        "logp_v1": roles["logp"].logprobs(tokens, micro_batch_size=2),
        "export_v2": roles["ref"].gather_hf_state_dict(),
        "export_v1": roles["logp"].gather_hf_state_dict(),
    }
    with torch.no_grad():  # new train weights, different on every chunk of every rank
        gen = torch.Generator().manual_seed(100 + rank)
        for chunk in roles["train"].chunks:
            for param in chunk.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * 0.01)
    sync_weights(groups, {"train": roles["train"], "logp": roles["logp"]}, None, version=1)
    out["train_after"] = roles["train"].gather_hf_state_dict()
    out["logp_after"] = roles["logp"].gather_hf_state_dict()
    return out


@pytest.fixture(scope="module")
def llama4(tiny_model):
    return str(tiny_model("llama", num_hidden_layers=4))


def test_logprobs_exports_and_weight_sync_with_two_chunks_per_rank(llama4, tmp_path):
    import transformers

    from megatron_async_rl.models import hf_checkpoint

    results = spawn(_forward_and_sync_worker, 2, tmp_path, llama4)
    assert all(r["chunks"] == [2, 1, 2] for r in results)
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama4, dtype=torch.float32).eval()
    tokens = _tokens(hf.config.vocab_size)
    with torch.no_grad():
        logits = hf(tokens).logits[:, :-1]
    reference = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    last = results[1]  # the last pipeline rank has the log-probs
    assert results[0]["logp_v2"] is None and last["logp_v2"] is not None
    (v2, _), (v1, _) = last["logp_v2"], last["logp_v1"]
    assert (v2 - reference).abs().max().item() <= 1e-4
    assert (v2 - v1).abs().max().item() <= 1e-5

    original = hf_checkpoint.load_hf_state_dict(llama4)
    first = results[0]
    for key in ("export_v2", "export_v1"):
        assert first[key].keys() == original.keys() and results[1][key] is None
        assert all(torch.equal(first[key][n], t) for n, t in original.items()), key
    trained, synced = first["train_after"], first["logp_after"]
    assert trained.keys() == original.keys()
    assert any(not torch.equal(trained[n], t) for n, t in original.items())
    assert all(torch.equal(synced[n], trained[n]) for n in trained)


def _train_worker(rank, world_size, tmp_dir, path, parallel):
    from megatron_async_rl.config.megatron.core_kwargs import virtual_stages

    return {**train_step_worker(rank, world_size, tmp_dir, path, parallel),
            "vp": virtual_stages(role_args(path, **parallel))}  # fmt: skip


def test_one_step_with_two_chunks_per_rank_equals_one_rank(tiny_model, tmp_path):
    """Tied embeddings: rank 0's first chunk holds the embedding, rank 1's last chunk its copy
    as the output layer; their gradients are summed across the two chunks' ranks. Also over
    2 data-parallel replicas (4 ranks) with the distributed optimizer and the overlapped grad
    reduce, whose DDP hooks the interleaved schedule drives chunk by chunk."""
    path = str(tiny_model("llama", num_hidden_layers=4, tie_word_embeddings=True))
    weights = {}
    overlap = {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
               "overlap_param_gather": True}  # hooks per chunk; gathered after the step
    layouts = (("pp1", 1, {}), ("vp2", 2, VP), ("vp2_dp2", 4, {**VP, **overlap}))
    for name, world, parallel in layouts:
        (tmp_path / name).mkdir()
        results = spawn(_train_worker, world, tmp_path / name, path, parallel)
        weights[name] = next(r["weights"] for r in results if r["weights"] is not None)
        assert len({round(r["metrics"]["actor/grad_norm"], 5) for r in results}) == 1
        assert {r["vp"] for r in results} == {2 if parallel else 1}
    reference = weights["pp1"]
    for name in ("vp2", "vp2_dp2"):
        assert weights[name].keys() == reference.keys()
        for key, tensor in reference.items():
            diff = (weights[name][key] - tensor).abs().max().item()
            assert diff <= 1e-6, f"{name} {key}: max abs diff {diff} vs pp1"


_CKPT = {"lr": 1e-3, "clip_grad": 0.0, "use_distributed_optimizer": True}


def _save_worker(rank, world_size, tmp_dir, path, ckpt):
    from pathlib import Path

    from megatron_async_rl.checkpoint.megatron_state import save_train_state

    role = one_window_roles("train", world_size, path, VP, extra=_CKPT)[0]["train"]
    seeded_step(role, 0)
    save_train_state(role, Path(ckpt))
    saved = role.gather_hf_state_dict()
    seeded_step(role, 1)
    return saved, role.gather_hf_state_dict()


def _load_worker(rank, world_size, tmp_dir, path, ckpt):
    from pathlib import Path

    from megatron_async_rl.checkpoint.megatron_state import load_train_state

    out = {}
    for name, parallel in (("vp2", VP), ("pp2", PP)):
        role = one_window_roles("train", world_size, path, parallel, extra=_CKPT)[0]["train"]
        load_train_state(role, Path(ckpt))
        out[name] = role.gather_hf_state_dict()
        if name == "vp2":
            seeded_step(role, 1)
            out["vp2_after"] = role.gather_hf_state_dict()
    return out


def test_checkpoint_saved_with_two_chunks_per_rank_loads_in_either_chunking(llama4, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for name in ("save", "load"):
        (tmp_path / name).mkdir()
    saved, uninterrupted = spawn(_save_worker, 2, tmp_path / "save", llama4, ckpt)[0]
    loaded = spawn(_load_worker, 2, tmp_path / "load", llama4, ckpt)[0]
    for name in ("vp2", "pp2"):
        assert loaded[name].keys() == saved.keys()
        assert all(torch.equal(loaded[name][k], t) for k, t in saved.items()), name
    assert all(torch.equal(loaded["vp2_after"][k], t) for k, t in uninterrupted.items())
    assert any(not torch.equal(uninterrupted[k], t) for k, t in saved.items())


def test_moe_routing_replay_with_two_chunks_per_rank(tiny_model, tmp_path):
    """`tests/distributed/test_routing_replay.py`'s contracts (record, replay token by token,
    the agreement counts, an optimizer step replaying with full recompute) with both the train
    and the logp role at pp = 2, V = 2: every chunk's routers take part."""
    path = str(tiny_model("qwen3_moe", num_hidden_layers=4))
    results = spawn(replay_worker, 4, tmp_path, path, {"train": VP, "logp": VP})
    assert check_results(results, "vp2", moe_layers=4) == {"train", "logp"}


def _heads_worker(rank, world_size, tmp_dir, paths):
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec

    args = role_args(paths["value"], **VP)
    par = Parallelism.from_megatron_args(args)
    layout = plan_layout(world_size, [RoleGroupSpec(roles=["logp"], num_ranks=2)], {"logp": par})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    return heads.head_outputs("logp", args, par, groups.roles["logp"], platform, paths)


def test_value_and_score_heads_with_two_chunks_per_rank(tiny_model, tmp_path):
    """A critic's values and a reward model's scores (the scalar head on the last chunk of the
    last rank) equal `transformers`' within 1e-4; their exports are the checkpoints."""
    paths = {kind: str(tiny_model("llama", num_hidden_layers=4, task=task))
             for kind, task in (("value", "token_classification"),
                                ("score", "sequence_classification"))}  # fmt: skip
    values, scores = heads.hf_values(paths["value"]), heads.hf_scores(paths["score"])
    first, last = spawn(_heads_worker, 2, tmp_path, paths)
    assert first["values"] is None and first["scores"] is None
    heads.check_heads(last, values, scores, "pp=2 V=2")
    heads.check_export(first["value_export"], paths["value"])
    heads.check_export(first["score_export"], paths["score"])
