"""--use-torch-fsdp2: the train role under megatron-core's FSDP2 wrapper, as under DDP.

Contract, on a tiny Llama (untied embeddings) over 2 gloo ranks of data parallelism, real
megatron-core and torch FSDP2 (parameters sharded DTensors), nothing faked:
- the exported HF state dict right after the HF load is the checkpoint, byte for byte;
- two optimizer steps (gradient clipping on) give the weights, exported, of the same steps
  under DDP within 1e-6, and the same grad norms (also with
  --torch-fsdp2-no-reshard-after-forward);
- a checkpoint saved under FSDP2 loads back into FSDP2, one saved under FSDP2 into DDP and one
  saved under DDP into FSDP2 (DDP without the distributed optimizer: the optimizer formats must
  match): the same weights, bit for bit, and the next step equals the uninterrupted run's (bit
  for bit under the same wrapper, within 1e-6 across them);
- weight sync from the FSDP2 train role into a logp role (one model chunk) leaves the logp
  role's weights equal to the train role's, bit for bit;
- a critic (value head) steps under FSDP2 as under DDP (grad norm, exported weights in 1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.ranks import spawn
from tests.harness.roles import one_window_roles
from tests.harness.train_steps import FSDP2, TRAIN, seeded_step


@pytest.fixture(scope="module")
def tiny_path(tiny_model):
    return str(tiny_model("llama", tie_word_embeddings=False))


def _steps_worker(rank, world_size, tmp_dir, path, extra):
    role = one_window_roles("train", world_size, path, {}, extra={**TRAIN, **extra})[0]["train"]
    loaded = role.gather_hf_state_dict()
    norms = [seeded_step(role, seed)["actor/grad_norm"] for seed in (0, 1)]
    sharded = all(type(p).__name__ == "DTensor" for c in role.chunks for p in c.parameters())
    reshard = getattr(role.models[0].ddp_config, "reshard_after_forward", None)
    return {"loaded": loaded, "trained": role.gather_hf_state_dict(), "norms": norms,
            "sharded": sharded, "reshard": reshard}  # fmt: skip


def test_two_steps_equal_ddp(tiny_path, tmp_path):
    """Also with --torch-fsdp2-no-reshard-after-forward (the weights stay gathered from the
    forward to the backward)."""
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    results = {}
    layouts = (
        ("ddp", {}),
        ("fsdp2", FSDP2),
        ("fsdp2_kept", {**FSDP2, "torch_fsdp2_reshard_after_forward": False}),
    )
    for name, extra in layouts:
        (tmp_path / name).mkdir()
        results[name] = spawn(_steps_worker, 2, tmp_path / name, tiny_path, extra)
    original = load_hf_state_dict(tiny_path)
    ddp = results["ddp"][0]
    assert not ddp["sharded"] and ddp["norms"][0] > TRAIN["clip_grad"]  # the clipping acts
    assert any(not torch.equal(ddp["trained"][k], t) for k, t in original.items())
    for name, reshard in (("fsdp2", True), ("fsdp2_kept", False)):
        fsdp = results[name][0]
        assert fsdp["sharded"] and fsdp["reshard"] is reshard, name
        assert fsdp["loaded"].keys() == original.keys() and results[name][1]["loaded"] is None
        assert all(torch.equal(fsdp["loaded"][k], t) for k, t in original.items())
        for r in results[name]:
            assert r["norms"] == pytest.approx(ddp["norms"], rel=1e-6), name
        for key, tensor in ddp["trained"].items():
            diff = (fsdp["trained"][key] - tensor).abs().max().item()
            assert diff <= 1e-6, f"{name} {key}: max abs diff {diff} vs DDP"


def _save_worker(rank, world_size, tmp_dir, path, ckpt, extra):
    from megatron_async_rl.checkpoint.megatron_state import save_train_state

    role = one_window_roles("train", world_size, path, {}, extra={**TRAIN, **extra})[0]["train"]
    seeded_step(role, 0)
    save_train_state(role, Path(ckpt))
    saved = role.gather_hf_state_dict()
    seeded_step(role, 1)
    return saved, role.gather_hf_state_dict()


def _load_worker(rank, world_size, tmp_dir, path, ckpt, extra):
    from megatron_async_rl.checkpoint.megatron_state import load_train_state

    role = one_window_roles("train", world_size, path, {}, extra={**TRAIN, **extra})[0]["train"]
    load_train_state(role, Path(ckpt))
    loaded = role.gather_hf_state_dict()
    seeded_step(role, 1)
    return loaded, role.gather_hf_state_dict()


@pytest.mark.parametrize("saved_with, loaded_with", [("fsdp2", "fsdp2"), ("fsdp2", "ddp"),
                                                     ("ddp", "fsdp2")])  # fmt: skip
def test_checkpoint_round_trip(tiny_path, tmp_path, saved_with, loaded_with):
    """The same weights, bit for bit; the next step as the uninterrupted run's (bit for bit
    under the same wrapper, within 1e-6 across them: the optimizer state came along)."""
    layouts = {"fsdp2": FSDP2, "ddp": {}}
    ckpt = str(tmp_path / "ckpt")
    for name in ("save", "load"):
        (tmp_path / name).mkdir()
    saved, uninterrupted = spawn(
        _save_worker, 2, tmp_path / "save", tiny_path, ckpt, layouts[saved_with]
    )[0]
    loaded, after = spawn(
        _load_worker, 2, tmp_path / "load", tiny_path, ckpt, layouts[loaded_with]
    )[0]
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], t) for k, t in saved.items())
    assert any(not torch.equal(uninterrupted[k], t) for k, t in saved.items())
    tolerance = 0.0 if saved_with == loaded_with else 1e-6
    for key, tensor in uninterrupted.items():
        diff = (after[key] - tensor).abs().max().item()
        assert diff <= tolerance, f"{key}: max abs diff {diff} vs the uninterrupted run"


def _sync_worker(rank, world_size, tmp_dir, path):
    from megatron_async_rl.weight_sync.broadcast import sync_weights

    windows = {"train": FSDP2, "logp": {}}
    roles, groups = one_window_roles("train", world_size, path, None, windows=windows, extra=TRAIN)
    seeded_step(roles["train"], 0)
    sync_weights(groups, roles, None, version=1)
    return roles["train"].gather_hf_state_dict(), roles["logp"].gather_hf_state_dict()


def test_weight_sync_into_logp(tiny_path, tmp_path):
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    trained, synced = spawn(_sync_worker, 2, tmp_path, tiny_path)[0]
    original = load_hf_state_dict(tiny_path)
    assert trained.keys() == synced.keys() == original.keys()
    assert any(not torch.equal(trained[k], t) for k, t in original.items())
    assert all(torch.equal(synced[k], trained[k]) for k in trained)


def _critic_worker(rank, world_size, tmp_dir, path, extra):
    """A critic (value head) on both ranks: one step of a squared error on its values."""
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    args = {**role_args(path), **TRAIN, **extra}
    par = Parallelism.from_megatron_args(args)
    spec = [RoleGroupSpec(roles=["critic"], num_ranks=world_size)]
    groups = build_world_groups(plan_layout(world_size, spec, {"critic": par}), "gloo")
    platform = detect_platform("cpu", "gloo")
    critic = MegatronRole("critic", args, par, groups.roles["critic"], platform, 5, head="value")
    critic.load_hf_checkpoint(path, head_init_std=0.02)
    tokens = _tokens()
    target = torch.linspace(-1.0, 1.0, tokens.numel()).view_as(tokens)

    def loss_fn(values_BT, entropy, batch):
        loss = ((values_BT - batch["target"]) ** 2).sum() / tokens.numel()
        return loss, {}

    micro = [{"tokens": tokens[i : i + 2], "target": target[i : i + 2]} for i in (0, 2)]
    norm = critic.train_step(micro, loss_fn, outputs="values")["actor/grad_norm"]
    return norm, critic.gather_hf_state_dict()


def _tokens():
    return torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(3))


def test_critic_step_equals_ddp(tiny_path, tmp_path):
    """A critic's value head (drawn, as from a policy checkpoint) trains under FSDP2 as under
    DDP: the same grad norm, exported weights within 1e-6."""
    out = {}
    for name, extra in (("ddp", {}), ("fsdp2", FSDP2)):
        (tmp_path / name).mkdir()
        out[name] = spawn(_critic_worker, 2, tmp_path / name, tiny_path, extra)[0]
    assert out["ddp"][0] > 0 and out["fsdp2"][0] == pytest.approx(out["ddp"][0], rel=1e-6)
    ddp, fsdp = out["ddp"][1], out["fsdp2"][1]
    assert fsdp.keys() == ddp.keys() and "score.weight" in ddp
    for key, tensor in ddp.items():
        diff = (fsdp[key] - tensor).abs().max().item()
        assert diff <= 1e-6, f"{key}: max abs diff {diff} vs DDP"
