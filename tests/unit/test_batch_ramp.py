"""Megatron-LM's --rampup-batch-size and --decrease-batch-size-if-needed: the G of each RL step.

Contract: `minibatch.global_batch_size_at` gives, for RL step k, the G megatron-core's own
calculator runs after k x B x ppo_epochs consumed samples; the sequences equal the ones worked
out by hand from Megatron-LM's rule (start + increment x floor(consumed / (ramp samples /
number of increments)), the final G past the ramp; rounded down to a multiple of micro-batch
size x data-parallel size with --decrease-batch-size-if-needed), and step k alone gives the G
it has in the sequence (a resumed run continues the ramp). `batch_ramp.check_batch_ramp`, at
config resolution and before the first train step, rejects every ramp megatron-core cannot build
and every G the run reaches that does not divide the rollout batch or breaks Megatron's
micro-batch rule, listing them, and the flags that count optimizer steps as RL steps x a fixed
number, each with a ConfigError naming the flag, the value, the rule and a fix.
`roles/learn.py:train_on_batch` trains on that G and logs it as `actor/global_batch_size`; the
lr schedule advances by G_k / G per optimizer step, which reproduces Megatron-LM's
sample-counted schedule (megatron-core's `OptimizerParamScheduler` driven in samples, the
reference). Faked: the train role of `train_on_batch` (a recording `train_step`). On a
megatron-core without the ramp calculator (0.19 removed it) the ramp is refused, naming the flag
and the release, and these tests skip (`test_the_ramp_is_refused_where_megatron_core_removed_it`
runs there).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_async_rl.algorithms import batch_ramp, minibatch
from megatron_async_rl.config.errors import ConfigError

_HAS_RAMP = hasattr(
    pytest.importorskip("megatron.core.num_microbatches_calculator"),
    "RampupBatchsizeNumMicroBatchesCalculator",
)
_NEEDS_RAMP = pytest.mark.skipif(not _HAS_RAMP, reason="megatron-core removed its ramp (0.19)")


def _args(ramp=None, gbs=64, mbs=1, decrease=False, **extra):
    return {"global_batch_size": gbs, "rampup_batch_size": ramp, "micro_batch_size": mbs,
            "decrease_batch_size_if_needed": decrease, **extra}  # fmt: skip


def _sequence(args, num_steps, num_samples=64, epochs=1, dp=1):
    return [
        minibatch.global_batch_size_at(args, k, num_samples, epochs, dp) for k in range(num_steps)
    ]


def _by_hand(start, increment, samples, gbs, consumed):
    """Megatron-LM's ramp, written out: G grows by `increment` every samples / n samples."""
    if consumed > samples:
        return gbs
    per_increment = samples / ((gbs - start) // increment)
    return start + increment * int(consumed / per_increment)


@pytest.mark.parametrize(
    ("ramp", "num_samples", "epochs", "expected"),
    [
        ((16, 16, 128), 64, 1, [16, 32, 64, 64, 64]),  # 48 falls between two RL steps
        ((16, 16, 128), 64, 2, [16, 64, 64]),  # 128 samples per RL step
        ((8, 8, 56), 64, 1, [8, 64, 64]),
        ((16, 16, 1536), 192, 1, [16, 16, 16, 32, 32, 32, 48, 48, 64, 64]),
    ],
)
@_NEEDS_RAMP
def test_the_ramp_follows_megatron_core(ramp, num_samples, epochs, expected):
    args = _args(list(ramp))
    assert _sequence(args, len(expected), num_samples, epochs) == expected
    consumed = [k * num_samples * epochs for k in range(len(expected))]
    assert expected == [_by_hand(*ramp, 64, c) for c in consumed]


@_NEEDS_RAMP
def test_a_resumed_run_continues_the_ramp():
    args = _args([16, 16, 1536])
    sequence = _sequence(args, 12, num_samples=192)
    batch_ramp._batch_sizes.cache_clear()  # a fresh process: nothing remembered
    assert [minibatch.global_batch_size_at(args, k, 192, 1, 1) for k in (7, 3, 11)] == [
        sequence[7],
        sequence[3],
        sequence[11],
    ]
    # each G of the run, from the RL step where it starts
    assert batch_ramp.batch_sizes(args, 192, 1, 1) == (
        (0, 16, 16), (3, 32, 32), (6, 48, 48), (8, 64, 64)
    )  # fmt: skip


@_NEEDS_RAMP
def test_without_the_flags_g_is_the_flag_and_megatron_is_not_asked(monkeypatch):
    monkeypatch.setattr(batch_ramp, "ramped_global_batch_size", None)  # would fail if called
    assert minibatch.global_batch_size_at(_args(gbs=32), 5, 64, 1, 4) == 32
    assert minibatch.global_batch_size_at(_args(gbs=None), 5, 64, 1, 4) is None


@_NEEDS_RAMP
def test_decrease_rounds_g_down_to_whole_micro_batches():
    # 48 over 32 ranks x 1 sample: 32; the ramp's 24 over 16 ranks: 16
    assert _sequence(_args(gbs=48, decrease=True), 2, dp=32) == [32, 32]
    args = _args([16, 8, 96], gbs=32, decrease=True)
    assert _sequence(args, 5, num_samples=32, dp=16) == [16, 16, 16, 32, 32]
    assert batch_ramp.batch_sizes(args, 32, 1, 16) == ((0, 16, 16), (2, 24, 16), (3, 32, 32))


@pytest.mark.parametrize(
    ("args", "dp", "pattern"),
    [
        (_args([16, 16, 128], gbs=None), 1,
         r"--rampup-batch-size = \[16, 16, 128\]: needs --global-batch-size"),
        (_args([16, 16]), 1, r"= \[16, 16\]: takes three integers: <start> <increment> <ramp"),
        (_args([64, 16, 128]), 1, r"<start> must be in \[1, --global-batch-size = 64\)"),
        (_args([16, 20, 128]), 1, r"<increment> must divide --global-batch-size - <start> = 48"),
        (_args([16, 16, 0]), 1, r"<ramp samples> must be >= 1 \(megatron-core divides by it\)"),
        (_args([16, 16, 1000]), 1,
         r"= \[16, 16, 1000\]: the global batch sizes it gives, 48 from RL step 11, must divide "
         r"the rollout batch of 64 samples .*hint: use a ramp whose G at every RL step divides "
         r"64 \(RL step k runs the G at k x 64 samples\)"),
        (_args([16, 16, 128]), 32,
         r"the global batch sizes it gives, 16 from RL step 0, must be a multiple of micro-batch "
         r"size x data-parallel size = 1 x 32 = 32; hint: add --decrease-batch-size-if-needed"),
        (_args([8, 8, 64], gbs=32, decrease=True), 16,
         r"--rampup-batch-size = \[8, 8, 64\]: the global batch sizes it gives, 8 \(run as 0\) "
         r"from RL step 0, round down to 0 as multiples of .* = 16"),
        (_args(gbs=8, decrease=True), 16,
         r"--decrease-batch-size-if-needed = True: the global batch sizes it gives, 8 \(run as "
         r"0\), round down to 0 .*hint: use a --global-batch-size of at least 16"),
        (_args(gbs=48, decrease=True), 16,
         r"the global batch sizes it gives, 48, must divide the rollout batch of 64 samples"),
    ],
)  # fmt: skip
@_NEEDS_RAMP
def test_bad_ramps_are_refused(args, dp, pattern):
    with pytest.raises(ConfigError, match=pattern):
        batch_ramp.check_batch_ramp(args, 64, 1, dp)
    with pytest.raises(ConfigError, match=pattern):  # the train stage, before its first step
        minibatch.global_batch_size_at(args, 0, 64, 1, dp)


@pytest.mark.parametrize(
    ("dest", "value", "fix"),
    [
        ("train_iters", 100, "use --train-samples"),
        ("iterations_to_skip", [3], "drop it"),
        ("exit_interval", 10, "drop it"),
        ("save_interval", 10, "use checkpoint.every_steps"),
    ],
)
@_NEEDS_RAMP
def test_a_varying_g_refuses_flags_counted_in_optimizer_steps(dest, value, fix):
    rule = "counts optimizer steps as RL steps x a fixed number here, and"
    flag = "--" + dest.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"{flag} = .*: {rule} --rampup-batch-size .*{fix}"):
        batch_ramp.check_batch_ramp(_args([16, 16, 128], **{dest: value}), 64, 1)
    lowered = _args(gbs=48, decrease=True, **{dest: value})
    with pytest.raises(ConfigError, match=rf"{flag} = .*--decrease-batch-size-if-needed \(G = 48 "
                       r"runs as 32\)"):  # fmt: skip
        batch_ramp.check_batch_ramp(lowered, 96, 1, 32)
    batch_ramp.check_batch_ramp(lowered, 96, 1, 16)  # 48 runs as 48: nothing varies


def _tree(**extra):
    tree = {
        "roles": {"groups": [{"roles": ["train", "logp", "ref"], "num_ranks": 1}]},
        "megatron": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                     "vocab_size": 128, "lr": 1e-5},
        "rollout": {"num_prompts_per_step": 8}, "algorithm": {"num_samples_per_prompt": 8},
    }  # fmt: skip
    tree.update(extra)
    return tree


@_NEEDS_RAMP
def test_the_recipe_checks_the_ramp():
    from megatron_async_rl.recipe.load import build_config

    # a grpo recipe, resolved as a dry run does (its checkpoint and data live elsewhere)
    tree = _tree(trainer={"job": "grpo"}, data={"path": "/elsewhere/prompts.jsonl"},
                 model={"hf_path": "/elsewhere/model"})  # fmt: skip
    tree["roles"]["groups"].append({"roles": ["generate"], "num_ranks": 1})
    flags = ["--global-batch-size", "64", "--rampup-batch-size", "16", "16", "128"]
    cfg = build_config(tree, [*flags, "--train-samples", "640"], check_paths=False)
    assert cfg.role_megatron_args["train"]["rampup_batch_size"] == [16, 16, 128]
    assert cfg.trainer.num_steps == 10  # an RL step consumes 64 samples whatever its G
    with pytest.raises(ConfigError, match=r"--rampup-batch-size = \[16, 16, 1000\]: .* 48 from "
                       r"RL step 11, must divide the rollout batch of 64"):  # fmt: skip
        build_config(tree, [*flags[:3], "16", "16", "1000"], check_paths=False)
    with pytest.raises(ConfigError, match=r"--train-iters = 20: counts optimizer steps"):
        build_config(tree, [*flags, "--train-iters", "20"], check_paths=False)


@_NEEDS_RAMP
def test_train_on_batch_runs_and_logs_the_ramps_g(tmp_path):
    import torch.distributed as dist

    from megatron_async_rl.algorithms.config import GRPOConfig
    from megatron_async_rl.roles import learn

    steps = []
    role = SimpleNamespace(
        args=_args([2, 2, 8], gbs=8), pgc=SimpleNamespace(dp=None), mask_moe_padding=False,
        train_step=lambda micro, loss_fn: steps.append(len(micro)) or {"actor/grad_norm": 1.0},
    )  # fmt: skip
    work = SimpleNamespace(
        step=0, batch={"tokens": torch.zeros(8, 4), "behaviour_logp": torch.zeros(8, 3)},
        loss_mask_BT=torch.ones(8, 3), adv_B=torch.zeros(8), logp_BT=torch.zeros(8, 3),
        ref_logp_BT=torch.zeros(8, 3),
    )  # fmt: skip
    cfg = SimpleNamespace(algorithm=GRPOConfig(shuffle_minibatches=False), seed=0,
                          moe=SimpleNamespace(routing_replay="off"))  # fmt: skip
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0,
                            world_size=1)  # fmt: skip
    try:
        logged = []
        for step in range(3):  # 8 samples per RL step, G at 0, 8, 16 samples: 2, 8, 8
            work.step, steps[:] = step, []
            metrics = learn.train_on_batch(role, work, cfg)
            logged.append((metrics["actor/global_batch_size"], metrics["actor/optimizer_steps"]))
            assert steps == [int(metrics["actor/global_batch_size"])] * len(steps)  # mbs 1
        assert logged == [(2.0, 4.0), (8.0, 1.0), (8.0, 1.0)]
    finally:
        dist.destroy_process_group()


@_NEEDS_RAMP
def test_the_lr_schedule_counts_samples_as_megatron_lm_does():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_async_rl.roles import lr_schedule

    assert lr_schedule.scheduler_increment({"global_batch_size": 64}, 64) == 1
    assert lr_schedule.scheduler_increment({"global_batch_size": None}, 48) == 1
    assert lr_schedule.scheduler_increment({"global_batch_size": 64}, 16) == 0.25

    args = {
        "lr": 1e-3,
        "min_lr": 1e-5,
        "lr_decay_style": "cosine",
        "lr_warmup_samples": 128,
        "lr_decay_samples": 1024,
        "global_batch_size": 64,
        "rampup_batch_size": [16, 16, 128],
    }

    def scheduler(**kwargs):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
        return OptimizerParamScheduler(optimizer, **kwargs)

    ours = scheduler(**lr_schedule.schedule_kwargs(args, None))
    # Megatron-LM: the schedule in samples, each iteration adds the global batch size it ran
    reference = scheduler(
        init_lr=0.0, max_lr=1e-3, min_lr=1e-5, lr_warmup_steps=128, lr_decay_steps=1024,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=1024,
        wd_incr_style="constant",
    )  # fmt: skip
    lrs = []
    for step in range(12):
        size = minibatch.global_batch_size_at(args, step, 64, 1, 1)
        for _ in range(64 // size):  # the RL step's optimizer steps
            lrs.append((ours.get_lr(ours.optimizer.param_groups[0]),
                        reference.get_lr(reference.optimizer.param_groups[0])))  # fmt: skip
            ours.step(increment=lr_schedule.scheduler_increment(args, size))
            reference.step(increment=size)
    assert len(lrs) > 12  # the ramp's small batches took more optimizer steps
    for got, want in lrs:
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.skipif(_HAS_RAMP, reason="this megatron-core has its ramp calculator")
def test_the_ramp_is_refused_where_megatron_core_removed_it():
    with pytest.raises(ConfigError, match=r"--rampup-batch-size.*no longer has.*0\.16\.x"):
        batch_ramp.check_batch_ramp(_args(ramp=[16, 16, 128]), 64, 1)
