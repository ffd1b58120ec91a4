"""Multi-token prediction under --use-torch-fsdp2, two gloo ranks (data parallel 2).

Contract: with --mtp-num-layers 2, two train steps under FSDP2 give DDP's `actor/mtp_loss`
(exactly) and grad norms (1e-6), and its weights, MTP layers included (1e-6); a Megatron
checkpoint saved under FSDP2 loads into a fresh FSDP2 role bit for bit and the next step
equals the uninterrupted run's. Nothing is faked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.mtp import FACTOR, NUM_MTP, mtp_micro_batches
from tests.harness.ranks import spawn
from tests.harness.roles import one_window_roles
from tests.harness.train_steps import FSDP2


def _loss(logp, entropy, batch):
    return -(logp * batch["mask"]).sum() / 20, {}


def _full(param) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def _worker(rank, world_size, tmp_dir, path, extra):
    from megatron_async_rl.checkpoint.megatron_state import load_train_state, save_train_state

    extra = {"lr": 1e-3, "clip_grad": 0.0, **extra, "mtp_num_layers": NUM_MTP,
             "mtp_loss_scaling_factor": FACTOR}  # fmt: skip

    def role(seed):
        return one_window_roles("train", world_size, path, {}, extra=extra, seed=seed)[0]["train"]

    micro = mtp_micro_batches()
    train = role(5)
    steps = [train.train_step(micro, _loss) for _ in range(2)]
    save_train_state(train, Path(tmp_dir) / "ckpt")
    again = role(9)  # other fresh MTP layers: the load must replace them
    load_train_state(again, Path(tmp_dir) / "ckpt")
    loaded = {n: _full(p) for n, p in again.chunks[0].named_parameters()}
    saved = {n: _full(p) for n, p in train.chunks[0].named_parameters()}
    resumed, uninterrupted = again.train_step(micro, _loss), train.train_step(micro, _loss)
    return {
        "sharded": any(type(p).__name__ == "DTensor" for p in train.chunks[0].parameters()),
        "mtp_loss": [m["actor/mtp_loss"] for m in steps],
        "grad_norm": [m["actor/grad_norm"] for m in steps],
        "saved": saved, "loaded": loaded,
        "next": [(m["actor/mtp_loss"], m["actor/grad_norm"]) for m in (resumed, uninterrupted)],
    }  # fmt: skip


def test_mtp_under_fsdp2_equals_ddp(tiny_model, tmp_path):
    path = str(tiny_model("llama"))
    out = {}
    for name, extra in (("ddp", {}), ("fsdp2", FSDP2)):
        (tmp_path / name).mkdir()
        out[name] = spawn(_worker, 2, tmp_path / name, path, extra)[0]
    ddp, fsdp = out["ddp"], out["fsdp2"]
    assert fsdp["sharded"] and not ddp["sharded"]
    assert fsdp["mtp_loss"] == ddp["mtp_loss"]
    assert fsdp["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-6)
    assert any(n.startswith("mtp.") for n in fsdp["saved"])
    for name, tensor in ddp["saved"].items():
        torch.testing.assert_close(fsdp["saved"][name], tensor, rtol=0, atol=1e-6, msg=name)
    for run in (ddp, fsdp):
        assert all(torch.equal(run["loaded"][n], t) for n, t in run["saved"].items())
        assert run["next"][0] == run["next"][1]
