"""Scalar heads (a critic's value head, a reward model's score head) inside a rank, and their
references from `transformers`; the contracts are `tests/distributed/test_head_parity.py`'s (its
docstring), also run with two virtual pipeline stages (`test_virtual_pipeline.py`) and on a GPU
(`tests/gpu/test_heads_cuda.py`).
"""

from __future__ import annotations

import torch

TOLERANCE = 1e-4
PAD_ID = 0  # `models.tiny`'s "<pad>", the tiny configs' pad_token_id
LENGTHS = (24, 17, 9, 1)  # right-padded rows


def head_tokens(vocab_size: int) -> torch.Tensor:
    """Right-padded rows of `LENGTHS` real tokens (seed 13), `PAD_ID` after them."""
    generator = torch.Generator().manual_seed(13)
    tokens = torch.randint(1, vocab_size, (len(LENGTHS), max(LENGTHS)), generator=generator)
    for row, length in enumerate(LENGTHS):
        tokens[row, length:] = PAD_ID
    return tokens


def hf_values(path: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(head_tokens(model.config.vocab_size)).logits[..., 0]


def hf_scores(path: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    )
    model.eval()
    tokens = head_tokens(model.config.vocab_size)
    with torch.no_grad():
        return model(tokens, attention_mask=(tokens != PAD_ID).long()).logits[:, 0]


def _value_step(role, tokens: torch.Tensor) -> dict:
    """One train step of a masked squared error on the values; the head's gradients after it
    (DDP's main_grad, as the optimizer left them: clipped by the same factor when the grad
    norms agree)."""
    target = torch.linspace(-1.0, 1.0, tokens.numel()).view_as(tokens)
    mask = (tokens != PAD_ID).float()
    total = mask.sum()

    def loss_fn(values_BT, entropy, batch):
        assert entropy is None
        loss = ((values_BT - batch["target"]) ** 2 * batch["mask"]).sum() / total
        return loss, {"value_loss": loss.detach()}

    micro_batches = [
        {"tokens": tokens[i : i + 2], "target": target[i : i + 2], "mask": mask[i : i + 2]}
        for i in range(0, tokens.shape[0], 2)
    ]
    metrics = role.train_step(micro_batches, loss_fn, outputs="values")
    out = {"metrics": metrics}
    if role.is_last_stage:
        head = role.module.output_layer
        out.update(weight_grad=head.weight.main_grad.clone(), bias_grad=head.bias.main_grad.clone())
    return out


def head_outputs(role, args, par, role_groups, platform, paths) -> dict:
    """Values, scores, exports (and, for `train`, a value step) of one role on this rank."""
    from megatron_async_rl.roles.megatron_role import MegatronRole

    out = {"role": role}
    critic = MegatronRole(role, args, par, role_groups, platform, seed=5, head="value")
    critic.load_hf_checkpoint(paths["value"])
    tokens = head_tokens(critic.spec.vocab_size)
    out["values"] = critic.values(tokens, micro_batch_size=2)
    out["value_export"] = critic.gather_hf_state_dict()
    if role == "train":
        out["step"] = _value_step(critic, tokens)
    reward = MegatronRole(role, args, par, role_groups, platform, seed=5, head="score")
    reward.load_hf_checkpoint(paths["score"])
    out["scores"] = reward.scores(tokens, PAD_ID, micro_batch_size=2)
    out["score_export"] = reward.gather_hf_state_dict()
    return out


def check_heads(result: dict, values_ref, scores_ref, label: str) -> dict:
    """Values and scores of one last stage against `transformers`; returns the max diffs."""
    diffs = {
        "values": (result["values"] - values_ref).abs().max().item(),
        "scores": (result["scores"] - scores_ref).abs().max().item(),
    }
    print(f"{label}: max abs diff {diffs}")
    assert result["values"].shape == values_ref.shape and result["scores"].shape == (len(LENGTHS),)
    assert max(diffs.values()) <= TOLERANCE, f"{label}: max abs diff {diffs}"
    return diffs


def check_export(exported: dict, path: str) -> None:
    from megatron_async_rl.models import hf_checkpoint

    original = hf_checkpoint.load_hf_state_dict(path)
    assert exported.keys() == original.keys()
    assert "score.weight" in exported and "lm_head.weight" not in exported
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
