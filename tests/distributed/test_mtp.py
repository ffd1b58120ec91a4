"""Multi-token prediction (--mtp-num-layers) trained beside the RL loss on the train role.

Contract, on one gloo rank with real megatron-core (nothing faked), a tiny Llama with N = 2 MTP
layers and mtp_loss_scaling_factor F = 0.3, one train step of two micro-batches (one row right-
padded):
- the log-probs the RL loss gets equal those of the same checkpoint built without MTP (1e-6),
  and so do the forward-only log-probs; a logp role given the flag builds no MTP layers;
- every gradient equals the one of a reference written out here, by plain autograd on the same
  modules: the RL loss (hand-written token log-probs) plus F / N x the mean over micro-batches
  of each MTP layer's cross-entropy, where MTP layer k at position t reads enorm(embedding of
  token t + k + 1) and hnorm(the previous hidden state) through eh_proj, its transformer layer
  and final norm, and predicts token t + k + 2 through the output layer, over real tokens only
  (DeepSeek-V3's definition, not megatron-core's forward); the MTP parameters' gradients are
  nonzero;
- `actor/mtp_loss` and `actor/mtp_<k>_loss` equal that reference's unscaled cross-entropies;
- the same gradients and metric with tied embeddings and for a tiny DeepSeek-V3 (multi-latent
  attention and MoE in the MTP layers);
- F = 0 gives the main parameters the gradients of the model without MTP, exactly;
- HF export and weight sync's rank state dict leave the MTP layers out (a Llama's have no HF
  names; DeepSeek-V3's: `test_mtp_hf.py`), and a Megatron checkpoint round trip restores them
  bit for bit;
- from the one-rank role's Megatron checkpoint, TP = 2, DP = 2 and PP = 2 give its MTP loss
  (on every rank) and weights after the step within 1e-6 (sequence parallelism needs
  Transformer Engine's norms: not on CPU); at PP = 2 the MTP stage's copy of the embedding
  stays equal to the first stage's, a PP = 2 checkpoint (tied or untied embeddings) resumes
  bit for bit at PP = 2 and within 1e-6 on one rank, and weight sync does not send the copy;
- on megatron-core 0.16.1 and 0.19.2 alike, PP = 2 with the MTP layers placed by a pipeline
  layout or in the last virtual stage trains as one rank does, and
  a logp role given the same layout (its MTP layers left out) builds and agrees.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.mtp import (
    FACTOR,
    NUM_MTP,
    embedding_copies,
    mtp_micro_batches,
    mtp_reference,
    mtp_role,
    mtp_step,
    reference_worker,
)
from tests.harness.ranks import spawn
from tests.harness.roles import one_window_roles


def _worker(rank, world_size, tmp_dir, path):
    from megatron_async_rl.checkpoint.megatron_state import load_train_state, save_train_state
    from megatron_async_rl.models import weights
    from megatron_async_rl.models.shards import rank_state_dict
    from megatron_async_rl.weight_sync.plan import TrainLayout, build_plan, check_stage_names

    micro = mtp_micro_batches()
    mtp = {"mtp_num_layers": NUM_MTP, "mtp_loss_scaling_factor": FACTOR}
    tokens = torch.cat([mb["tokens"] for mb in micro])
    plain = mtp_role(path, None)
    plain_forward = plain.logprobs(tokens, 2)[0]
    plain_metrics, plain_logp, plain_grads = mtp_step(plain, micro)

    role = mtp_role(path, mtp)
    forward = role.logprobs(tokens, 2)[0]  # a forward-only pass: the MTP layers do not run
    ref_grads, ref_ce = mtp_reference(role.chunks[0], micro, role.spec.vocab_size)
    mtp_names = [n for n, _ in role.chunks[0].named_parameters() if n.startswith("mtp.")]
    metrics, logp, grads = mtp_step(role, micro)
    try:
        role.train_step([{k: v for k, v in micro[0].items() if k != "padding"}], None)
        no_padding = None
    except RuntimeError as error:
        no_padding = str(error)

    logp_role = mtp_role(path, mtp, "logp")
    logp_forward = logp_role.logprobs(tokens, 2)[0]
    logp_names = [n for n, _ in logp_role.chunks[0].named_parameters()]
    zero = mtp_role(path, {**mtp, "mtp_loss_scaling_factor": 0.0})
    _, _, zero_grads = mtp_step(zero, micro)

    dims = weights.model_dims(role.args, role.spec)
    reshard = build_plan(TrainLayout(offset=0, tp=1, pp=1, dp=1), dims, "float32", 1 << 20,
                         1 << 18)  # fmt: skip
    local = list(weights.full_rank_state_dict(role.chunks))
    check_stage_names(reshard, 0, local, 0, 0)  # what weight sync checks first: no error
    try:  # the MTP names themselves have no HF names: that is why they are left out
        check_stage_names(reshard, 0, [*local, *mtp_names], 0, 0)
        unmapped = None
    except ValueError as error:
        unmapped = str(error)
    ckpt = Path(tmp_dir) / "ckpt"
    save_train_state(role, ckpt)
    saved = {n: p.detach().clone() for n, p in role.chunks[0].named_parameters()}
    restored = mtp_role(path, mtp)
    fresh = {n: p.detach().clone() for n, p in restored.chunks[0].named_parameters()}
    load_train_state(restored, ckpt)
    return {
        "plain_logp": plain_logp, "logp": logp, "plain_forward": plain_forward,
        "forward": forward, "logp_forward": logp_forward, "logp_names": logp_names,
        "plain_grads": plain_grads, "grads": grads, "ref_grads": ref_grads,
        "zero_grads": zero_grads, "ref_ce": ref_ce, "metrics": metrics,
        "plain_metrics": plain_metrics, "mtp_names": mtp_names,
        "exported": sorted(role.gather_hf_state_dict()),
        "rank_names": sorted(rank_state_dict(role.chunks)),
        "full_names": sorted(weights.full_rank_state_dict(role.chunks)),
        "saved": saved, "synced": sorted(reshard.params_of(0)), "unmapped": unmapped,
        "no_padding": no_padding, "fresh": fresh,
        "restored": {n: p.detach().clone() for n, p in restored.chunks[0].named_parameters()},
    }  # fmt: skip


@pytest.fixture(scope="module")
def result(tiny_model, tmp_path_factory):
    path = str(tiny_model("llama"))
    return spawn(_worker, 1, tmp_path_factory.mktemp("mtp"), path)[0]


def test_rl_logprobs_are_those_of_the_model_without_mtp(result):
    for got, want in zip(result["logp"], result["plain_logp"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(result["forward"], result["plain_forward"], rtol=0, atol=1e-6)
    assert result["metrics"]["loss"] == pytest.approx(result["plain_metrics"]["loss"], abs=1e-6)
    assert "actor/mtp_loss" not in result["plain_metrics"]


def test_the_logp_role_builds_no_mtp_layers(result):
    assert result["logp_names"] and not any("mtp" in n for n in result["logp_names"])
    torch.testing.assert_close(result["logp_forward"], result["plain_forward"], rtol=0, atol=0)


def test_gradients_are_rl_plus_scaled_mtp_cross_entropy(result):
    grads, ref = result["grads"], result["ref_grads"]
    assert grads.keys() == ref.keys()
    for name, want in ref.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert len(result["mtp_names"]) >= 2 * 9
    for name in result["mtp_names"]:
        assert grads[name].abs().sum() > 0, name
    # the MTP loss reaches the main parameters too (the decoder, the embedding)
    changed = [n for n in result["plain_grads"]
               if not torch.equal(result["plain_grads"][n], grads[n])]  # fmt: skip
    assert "embedding.word_embeddings.weight" in changed
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in changed


@pytest.mark.parametrize("family, overrides", [
    ("llama", {"tie_word_embeddings": True}),  # the MTP logits through the embedding
    ("deepseek_v3", {}),  # multi-latent attention and MoE in the MTP layers
])  # fmt: skip
def test_tied_and_deepseek_gradients_are_the_reference(family, overrides, tiny_model, tmp_path):
    path = str(tiny_model(family, **overrides))
    got = spawn(reference_worker, 1, tmp_path, path)[0]
    for name, want in got["ref_grads"].items():
        torch.testing.assert_close(got["grads"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert got["metrics"]["actor/mtp_loss"] == pytest.approx(float(got["ref_ce"].mean()), abs=1e-5)


def test_mtp_loss_metric_is_the_reference_cross_entropy(result):
    metrics, ref_ce = result["metrics"], result["ref_ce"]
    for k in range(NUM_MTP):
        assert metrics[f"actor/mtp_{k + 1}_loss"] == pytest.approx(float(ref_ce[k]), abs=1e-5)
    assert metrics["actor/mtp_loss"] == pytest.approx(float(ref_ce.mean()), abs=1e-5)


def test_mtp_steps_need_the_padding(result):
    assert "--mtp-num-layers trains on the real tokens, and a micro-batch has no `padding`" in (
        result["no_padding"])  # fmt: skip


def test_zero_factor_leaves_the_main_gradients_alone(result):
    for name, want in result["plain_grads"].items():
        assert torch.equal(result["zero_grads"][name], want), name


def test_export_and_weight_sync_skip_mtp_names(result):
    assert result["mtp_names"]
    assert not any("mtp" in name for name in result["exported"])
    assert not any(name.startswith("mtp.") for name in result["rank_names"])
    assert result["full_names"] == result["rank_names"]
    assert "model.layers.1.mlp.down_proj.weight" in result["exported"]
    assert result["synced"] == result["rank_names"]  # weight sync sends exactly these
    assert "mtp." in result["unmapped"]


def test_checkpoint_round_trip_restores_mtp_layers(result):
    saved, restored = result["saved"], result["restored"]
    assert saved.keys() == restored.keys()
    for name in result["mtp_names"]:
        assert torch.equal(restored[name], saved[name]), name
        assert not torch.equal(result["fresh"][name], saved[name]), name  # trained, then loaded
    for name, tensor in saved.items():
        assert torch.equal(restored[name], tensor), name


LAYOUTS = {
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "dp2": (2, {}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),  # the MTP layers on the second stage
    "tp2pp2": (4, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
}


def _layout_worker(rank, world_size, tmp_dir, path, parallel, ckpt):
    """A train step from the Megatron checkpoint `ckpt` (None: one step, saved there, first):
    a fresh MTP layer's initialisation depends on the layout, a checkpoint does not."""
    from megatron_async_rl.checkpoint.megatron_state import load_train_state, save_train_state

    extra = {"lr": 1e-3, "clip_grad": 0.0, "mtp_num_layers": NUM_MTP,
             "mtp_loss_scaling_factor": FACTOR, "use_distributed_optimizer": True}  # fmt: skip
    role = one_window_roles("train", world_size, path, parallel, extra=extra)[0]["train"]
    micro = mtp_micro_batches()
    if ckpt is None:
        mtp_step(role, [{**mb, "tokens": mb["tokens"].roll(1, dims=1)} for mb in micro])
        save_train_state(role, Path(tmp_dir) / "saved")
    else:
        load_train_state(role, Path(ckpt))
    total = sum(mb["mask"].sum() for mb in micro)  # the whole step's, on every DP rank
    dp_rank = torch.distributed.get_rank(role.pgc.dp)
    if torch.distributed.get_world_size(role.pgc.dp) > 1:
        micro = micro[dp_rank : dp_rank + 1]
    metrics, _, _ = mtp_step(role, micro, total)
    return {"metrics": metrics, "weights": role.gather_hf_state_dict(),
            "embeddings": embedding_copies(role), "sync": _sync_names(role)}  # fmt: skip


def _sync_names(role) -> tuple[list, list]:
    """(the names weight sync plans for this rank, MTP left out; those it sends)."""
    import dataclasses

    from megatron_async_rl.models import weights
    from megatron_async_rl.models.shards import stage_entries

    dims = dataclasses.replace(weights.model_dims(role.args, role.spec), mtp_num_layers=0)
    planned = stage_entries(dims, **weights.stage_ranks(role.pgc))
    sent = weights.full_rank_state_dict(role.chunks, mtp_num_layers=0)
    return sorted(e.local for e in planned), sorted(sent)


def test_layouts_agree(tiny_model, tmp_path):
    """TP = 2, DP = 2, PP = 2 (the MTP layers and a copy of the embedding on the second
    stage) and TP = 2 x PP = 2, from the one-rank role's Megatron checkpoint after a step, train
    the MTP layers as one rank does: the same `actor/mtp_loss` on every rank and, after their
    step, the same main weights (which the MTP loss moves too) within 1e-6, the two embeddings
    equal."""
    path = str(tiny_model("llama"))
    (tmp_path / "tp1").mkdir()
    one_rank = spawn(_layout_worker, 1, tmp_path / "tp1", path, {}, None)[0]
    for name, (world, parallel) in LAYOUTS.items():
        (tmp_path / name).mkdir()
        results = spawn(_layout_worker, world, tmp_path / name, path, parallel,
                        str(tmp_path / "tp1" / "saved"))  # fmt: skip
        for got in results:
            assert got["metrics"]["actor/mtp_loss"] == pytest.approx(
                one_rank["metrics"]["actor/mtp_loss"], abs=1e-6), name  # fmt: skip
        for got in results:  # the MTP stage's copy of the embedding stays the first stage's
            assert all(torch.equal(c, got["embeddings"][0]) for c in got["embeddings"]), name
            assert len(got["embeddings"]) == (2 if name.endswith("pp2") else 1), name
        weights = next(r["weights"] for r in results if r["weights"] is not None)
        for key, tensor in one_rank["weights"].items():
            diff = (weights[key] - tensor).abs().max().item()
            assert diff <= 1e-6, f"{name} {key}: max abs diff {diff} vs one rank"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_pipeline_checkpoint_round_trip(tied, tiny_model, tmp_path):
    """A PP = 2 role's Megatron checkpoint (the MTP stage's copy of the embedding and its MTP
    layers in it) resumes bit for bit at PP = 2, and one rank resumes it as PP = 2 goes on
    (1e-6); with tied embeddings the copy is the MTP layers' LM head too. Weight sync's plan
    for each stage is what the stage sends: the copy is not sent."""
    path = str(tiny_model("llama", tie_word_embeddings=tied))
    pp2 = {"pipeline_model_parallel_size": 2}
    for name in ("first", "resumed", "one_rank"):
        (tmp_path / name).mkdir()
    first = spawn(_layout_worker, 2, tmp_path / "first", path, pp2, None)
    saved = str(tmp_path / "first" / "saved")
    resumed = spawn(_layout_worker, 2, tmp_path / "resumed", path, pp2, saved)
    one_rank = spawn(_layout_worker, 1, tmp_path / "one_rank", path, {}, saved)[0]
    for got, want in zip(resumed, first, strict=True):
        assert got["metrics"]["actor/mtp_loss"] == want["metrics"]["actor/mtp_loss"]
        assert got["metrics"]["actor/mtp_loss"] == pytest.approx(
            one_rank["metrics"]["actor/mtp_loss"], abs=1e-6)  # fmt: skip
        assert len(got["embeddings"]) == 2 and torch.equal(*got["embeddings"])
        planned, sent = got["sync"]  # weight sync sends the first stage's embedding only
        assert planned == sent
        assert ("embedding.word_embeddings.weight" in sent) == (got is resumed[0])
    weights = resumed[0]["weights"]
    for key, tensor in first[0]["weights"].items():
        assert torch.equal(weights[key], tensor), key
        diff = (one_rank["weights"][key] - tensor).abs().max().item()
        assert diff <= 1e-6, f"{key}: max abs diff {diff} vs one rank"


MTP_PIPELINES = {  # 4 layers, the MTP layers on the last stage: by the layout, in the last chunk
    "layout": {"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|tttmmL"},
    "vp2": {"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2},
}


def _logp_beside_worker(rank, world_size, tmp_dir, path, parallel):
    """The train role and a logp role with the same flags (MTP and its layout), side by side:
    their forward log-probs."""
    extra = {"lr": 1e-3, "mtp_num_layers": NUM_MTP, "mtp_loss_scaling_factor": FACTOR}
    roles, _ = one_window_roles("train", world_size, path, None, extra=extra,
                                windows={"train": parallel, "logp": parallel})  # fmt: skip
    tokens = torch.cat([mb["tokens"] for mb in mtp_micro_batches()])
    return {name: roles[name].logprobs(tokens, 2) for name in ("train", "logp")}


@pytest.mark.parametrize("name", list(MTP_PIPELINES))
def test_layout_and_virtual_stages_train_as_one_rank(name, tiny_model, tmp_path):
    """PP = 2 with the MTP layers placed by a layout ('Et|tttmmL', uneven stages) or in the
    last of two virtual stages trains as one rank does, from its Megatron checkpoint: the same
    `actor/mtp_loss` on both ranks and main weights within 1e-6, the MTP stage's copy of the
    embedding equal to the first stage's; a logp role given the same flags (its layout's MTP
    layers left out) computes the train role's log-probs."""
    path = str(tiny_model("llama", num_hidden_layers=4))
    for sub in ("one", name, "logp"):
        (tmp_path / sub).mkdir()
    one_rank = spawn(_layout_worker, 1, tmp_path / "one", path, {}, None)[0]
    results = spawn(_layout_worker, 2, tmp_path / name, path, MTP_PIPELINES[name],
                    str(tmp_path / "one" / "saved"))  # fmt: skip
    for got in results:
        assert got["metrics"]["actor/mtp_loss"] == pytest.approx(
            one_rank["metrics"]["actor/mtp_loss"], abs=1e-6)  # fmt: skip
        assert len(got["embeddings"]) == 2 and torch.equal(*got["embeddings"])
    weights = next(r["weights"] for r in results if r["weights"] is not None)
    for key, tensor in one_rank["weights"].items():
        diff = (weights[key] - tensor).abs().max().item()
        assert diff <= 1e-6, f"{name} {key}: max abs diff {diff} vs one rank"
    beside = spawn(_logp_beside_worker, 2, tmp_path / "logp", path, MTP_PIPELINES[name])
    last = [got for got in beside if got["train"] is not None]  # the last stage's
    assert len(last) == 1
    for train, logp in zip(last[0]["train"], last[0]["logp"], strict=True):
        torch.testing.assert_close(logp, train, rtol=0, atol=1e-6)
