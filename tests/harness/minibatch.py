"""PPO mini-batch steps inside a rank (`roles.learn.train_on_batch`: B = 8 samples,
--global-batch-size 4, two optimizer steps) and the hand-written reference they are checked
against (`transformers`, the GRPO clipped surrogate, torch Adam); the contracts are
`tests/distributed/test_minibatch_step.py`'s, also run on a GPU (`tests/gpu/test_learn_cuda.py`).
"""

from types import SimpleNamespace

import torch

from tests.harness.roles import role_args

NUM_SAMPLES, GLOBAL_BATCH_SIZE, SEED, STEP = 8, 4, 3, 5
# adam_eps 1e-6, not the default 1e-8: Adam's first step is lr * g / (|g| + eps), so with 1e-8 a
# gradient entry near 0 on which fp32 Megatron and transformers disagree in sign moves 2 lr apart
# (seen: 1.8e-4 on one lm_head entry). With 1e-6 the weights agree to ~4e-6, while normalising
# each step by the whole batch's counts instead of its mini-batch's is 2e-4 off, an unshuffled
# split or a single step 3e-3.
OPTIM = {"lr": 1e-3, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-6}
MODES = ("token-mean", "seq-mean-token-mean")


def minibatch_data(path: str) -> dict:
    """Tokens, a ragged response mask (sample 6 empty), advantages and the starting policy's
    log-probs (from `transformers`), the same on every rank."""
    generator = torch.Generator().manual_seed(4)
    tokens = torch.randint(1, 96, (NUM_SAMPLES, 12), generator=generator)  # 0: HF pad row
    mask = torch.zeros(NUM_SAMPLES, 11)
    mask[:, 4:] = 1.0
    for row, end in ((1, 9), (2, 6), (5, 8)):
        mask[row, end:] = 0.0
    mask[6] = 0.0
    adv = torch.randn(NUM_SAMPLES, generator=generator)
    with torch.no_grad():
        old_logp = _logp(_hf_model(path), tokens)
    # build_batch's lengths: 5 prompt tokens, 7 response tokens, no padding (an MoE role's
    # padding mask comes from them: rollout.batch.padding_BT)
    lengths = {"prompt_len": torch.full((NUM_SAMPLES,), 5.0),
               "response_len": torch.full((NUM_SAMPLES,), 7.0)}  # fmt: skip
    return {"tokens": tokens, "mask": mask, "adv": adv, "old_logp": old_logp, **lengths}


def _hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _logp(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def minibatch_worker(rank, world_size, tmp_dir, path, data, micro_batch_size, device="cpu",
                     bf16=False, extra=None):  # fmt: skip
    """A train role over the whole world through `train_on_batch` on `data`, once per loss
    aggregation mode: {mode: {"weights": exported, "metrics": ...}}."""
    from megatron_async_rl.algorithms.config import GRPOConfig
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.learn import train_on_batch
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from megatron_async_rl.roles.work import StepWork

    args = role_args(path, bf16=True) if bf16 else role_args(path)
    args.update(OPTIM, clip_grad=0.0, weight_decay=0.0)
    args.update(micro_batch_size=micro_batch_size, global_batch_size=GLOBAL_BATCH_SIZE)
    args.update(extra or {})
    par = Parallelism.from_megatron_args(args)
    groups_spec = [RoleGroupSpec(["train"], num_ranks=world_size)]
    layout = plan_layout(world_size, groups_spec, {"train": par})
    platform = detect_platform(device, "nccl" if device == "cuda" else "gloo")
    groups = build_world_groups(layout, platform.backend)
    out = {}
    for mode in MODES:
        role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
        role.load_hf_checkpoint(path)
        cfg = SimpleNamespace(
            algorithm=GRPOConfig(loss_agg_mode=mode),
            trainer=SimpleNamespace(micro_batch_size=None),
            moe=SimpleNamespace(routing_replay="off"),
            seed=SEED,
        )
        work = StepWork(
            step=STEP,
            batch={
                "tokens": data["tokens"],
                "behaviour_logp": data["old_logp"],
                "prompt_len": data["prompt_len"],
                "response_len": data["response_len"],
            },
            logp_BT=data["old_logp"],
            ref_logp_BT=data["old_logp"],
            adv_B=data["adv"],
            loss_mask_BT=data["mask"],
        )
        metrics = train_on_batch(role, work, cfg)
        out[mode] = {"weights": role.gather_hf_state_dict(), "metrics": metrics}
    return out


def minibatch_reference(path: str, data: dict, mode: str):
    """Weights, mean loss and grad norms of two hand-written GRPO steps with torch Adam."""
    from megatron_async_rl.algorithms.minibatch import plan_minibatches

    model = _hf_model(path)
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (OPTIM["adam_beta1"], OPTIM["adam_beta2"])
    optimizer = torch.optim.Adam(params, lr=OPTIM["lr"], betas=betas, eps=OPTIM["adam_eps"])
    plan = plan_minibatches(NUM_SAMPLES, GLOBAL_BATCH_SIZE, 1, True, SEED, STEP)
    assert plan[0] != [0, 1, 2, 3]  # shuffled: the test must tell a shuffled split apart
    step_losses, grad_norms = [], []
    for samples in plan:
        rows = torch.tensor(samples)
        tokens, mask, adv = data["tokens"][rows], data["mask"][rows], data["adv"][rows, None]
        ratio = (_logp(model, tokens) - data["old_logp"][rows]).exp()
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * mask
        if mode == "token-mean":
            loss = pg.sum() / mask.sum()
        else:  # seq-mean-token-mean over the samples with any real token
            lengths = mask.sum(-1)
            loss = (pg.sum(-1) / lengths.clamp(min=1)).sum() / (lengths > 0).sum()
        optimizer.zero_grad()
        loss.backward()
        grad_norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        step_losses.append(loss.item())
        optimizer.step()
    return model.state_dict(), sum(step_losses) / 2, [g.item() for g in grad_norms]
