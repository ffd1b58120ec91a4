"""`algorithm.old_logprobs: trainer` is today's step exactly: no logp pass, the train forward's
own log-probs as the old ones.

Contract, on real megatron-core roles (one gloo rank, a tiny Llama, fp32): an RL step of one
optimizer step with the old log-probs from a logp role's pass (a second role of the same
checkpoint, as `[train, logp]` places it) and the same step with none (`train_on_batch` with
`logp_BT` None: the loss takes the train forward's, detached) leave bit-identical weights and
report equal metrics, for token-mean and seq-mean-token-mean; a step that plans two optimizer
steps refuses to run without old log-probs. The run-level twin (the quick start with and without
logp and ref: every shared metric equal) is in the note of issue 38.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness.minibatch import MODES, OPTIM, minibatch_data
from tests.harness.ranks import spawn


def _worker(rank, world_size, tmp_dir, path, data):
    from types import SimpleNamespace

    from megatron_async_rl.algorithms.config import GRPOConfig
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.learn import train_on_batch
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from megatron_async_rl.roles.work import StepWork
    from tests.harness.roles import role_args

    num = data["tokens"].shape[0]
    args = role_args(path)
    args.update(OPTIM, clip_grad=0.0, weight_decay=0.0, micro_batch_size=4,
                global_batch_size=num)  # fmt: skip
    par = Parallelism.from_megatron_args(args)
    spec = [RoleGroupSpec(["train", "logp"], num_ranks=world_size)]
    layout = plan_layout(world_size, spec, {"train": par, "logp": par})
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    logp_role = MegatronRole("logp", args, par, groups.roles["logp"], platform, seed=5)
    logp_role.load_hf_checkpoint(path)
    old = logp_role.logprobs(data["tokens"], 4, None)[0]
    out = {}
    for mode in MODES:
        for source in ("logp", "trainer"):
            role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
            role.load_hf_checkpoint(path)
            cfg = SimpleNamespace(algorithm=GRPOConfig(loss_agg_mode=mode),
                                  trainer=SimpleNamespace(micro_batch_size=None),
                                  moe=SimpleNamespace(routing_replay="off"), seed=3)  # fmt: skip
            work = StepWork(
                step=0,
                batch={"tokens": data["tokens"], "behaviour_logp": data["old_logp"],
                       "prompt_len": data["prompt_len"], "response_len": data["response_len"]},
                logp_BT=old if source == "logp" else None,
                adv_B=data["adv"], loss_mask_BT=data["mask"],
            )  # fmt: skip
            metrics = train_on_batch(role, work, cfg)
            out[(mode, source)] = {"weights": role.gather_hf_state_dict(), "metrics": metrics}
    args["global_batch_size"] = num // 2  # two optimizer steps: the second's old log-probs
    role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
    role.load_hf_checkpoint(path)
    work = StepWork(step=0, batch={"tokens": data["tokens"], "behaviour_logp": data["old_logp"]},
                    logp_BT=None, adv_B=data["adv"], loss_mask_BT=data["mask"])  # fmt: skip
    try:
        train_on_batch(role, work, cfg)
        out["refused"] = None
    except RuntimeError as err:
        out["refused"] = str(err)
    return out


def test_trainer_old_logprobs_equal_a_logp_pass_exactly(tiny_model, tmp_path):
    path = str(tiny_model("llama"))
    data = minibatch_data(path)
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    start = load_hf_state_dict(path)
    (result,) = spawn(_worker, 1, tmp_path, path, data)
    for mode in MODES:
        passed, own = result[(mode, "logp")], result[(mode, "trainer")]
        assert own["metrics"] == passed["metrics"], mode
        assert own["metrics"]["actor/optimizer_steps"] == 1.0
        assert any(not t.equal(start[k]) for k, t in passed["weights"].items())  # it stepped
        for name, tensor in passed["weights"].items():
            assert torch.equal(own["weights"][name], tensor), f"{mode} {name}"
        assert passed["metrics"]["actor/ratio_mean"] == pytest.approx(1.0)  # one step: r = 1
    assert "old_logprobs is trainer" in result["refused"] and "2 optimizer steps" in \
        result["refused"]  # fmt: skip
