"""`rollout.batch.build_batch`: the layout every Megatron role and the loss read, checked by hand
on a small step and against a per-sample reference on random steps (multi-turn masks, empty
responses, environment tokens of version "")."""

from __future__ import annotations

import random

import torch

from megatron_async_rl.engines.protocol import version_number
from megatron_async_rl.rollout.batch import build_batch
from megatron_async_rl.rollout.generation import Sample


def sample(prompt, response, logprobs, versions, loss_mask=None, reward=0.0) -> Sample:
    return Sample(uid="u", prompt_index=0, sample_index=0, prompt_ids=prompt,
                  response_ids=response, response_logprobs=logprobs, token_versions=versions,
                  finish_reason="stop", answer="", reward=reward, loss_mask=loss_mask)  # fmt: skip


def reference(samples, pad_id: int, multiple: int) -> dict[str, torch.Tensor]:
    """The layout written one sample at a time, as tensor slices."""
    seq_len = -(-max(len(s.prompt_ids) + len(s.response_ids) for s in samples) // multiple)
    seq_len *= multiple
    tokens = torch.full((len(samples), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(len(samples), seq_len - 1)
    behaviour = torch.zeros(len(samples), seq_len - 1)
    versions = torch.zeros(len(samples), seq_len - 1, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        tokens[i, :p] = torch.tensor(s.prompt_ids)
        if r:
            tokens[i, p : p + r] = torch.tensor(s.response_ids)
            trained = s.loss_mask if s.loss_mask is not None else [1.0] * r
            mask[i, p - 1 : p - 1 + r] = torch.tensor(trained, dtype=mask.dtype)
            behaviour[i, p - 1 : p - 1 + r] = torch.tensor(s.response_logprobs)
            versions[i, p - 1 : p - 1 + r] = torch.tensor(
                [version_number(v) for v in s.token_versions]
            )
    return {"tokens": tokens, "mask": mask, "behaviour_logp": behaviour, "versions": versions}


def test_a_small_step_by_hand():
    samples = [
        sample([5, 6], [7, 8, 2], [-0.5, -0.25, -1.0], ["v3", "v3", "v4"], reward=1.0),
        sample([5], [9], [-2.0], ["v4"]),
    ]
    batch = build_batch(samples, pad_id=0, multiple=4)
    assert batch["tokens"].tolist() == [[5, 6, 7, 8, 2, 0, 0, 0], [5, 9, 0, 0, 0, 0, 0, 0]]
    # column t predicts token t + 1: sample 0's response starts at column 1, sample 1's at 0
    assert batch["mask"].tolist() == [[0, 1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    assert batch["behaviour_logp"].tolist() == [[0, -0.5, -0.25, -1.0, 0, 0, 0],
                                                [-2.0, 0, 0, 0, 0, 0, 0]]  # fmt: skip
    assert batch["versions"].tolist() == [[0, 3, 3, 4, 0, 0, 0], [4, 0, 0, 0, 0, 0, 0]]
    assert batch["rewards"].tolist() == [1.0, 0.0]
    assert batch["response_len"].tolist() == [3, 1] and batch["prompt_len"].tolist() == [2, 1]
    assert batch["mask"].dtype == batch["behaviour_logp"].dtype == torch.get_default_dtype()
    assert batch["tokens"].dtype == batch["versions"].dtype == torch.long
    assert batch["routing"] is None and batch["routing_valid"] is None


def test_random_steps_equal_the_per_sample_layout():
    rng = random.Random(0)
    for trial in range(20):
        samples = []
        for _ in range(rng.randint(1, 12)):
            p, r = rng.randint(1, 9), rng.randint(0, 11)
            multi_turn = rng.random() < 0.5
            loss_mask = [rng.randint(0, 1) for _ in range(r)] if multi_turn else None
            versions = [f"v{rng.randint(1, 5)}" for _ in range(r)]
            if multi_turn:
                versions = [v if m else "" for v, m in zip(versions, loss_mask)]
            samples.append(sample([rng.randint(1, 90) for _ in range(p)],
                                  [rng.randint(1, 90) for _ in range(r)],
                                  [-rng.random() * 3 for _ in range(r)], versions, loss_mask,
                                  rng.random()))  # fmt: skip
        multiple = rng.choice([1, 8])
        got, want = build_batch(samples, 95, multiple), reference(samples, 95, multiple)
        for key, expected in want.items():
            assert got[key].dtype == expected.dtype, (trial, key)
            assert torch.equal(got[key], expected), (trial, key)
