"""Vocab-parallel log-probs over a real TP=2 gloo group equal the single-rank computation.

Contract: values (log-prob and entropy) and gradients with respect to each rank's logits shard
match the unsharded computation, including Megatron vocab padding on the last shard. The
gradient check pins the backward semantics: the loss is replicated on every TP rank, so the
reduction's backward must be the identity (a summing backward would scale grads by TP).
Nothing is faked: two spawned gloo ranks.
"""

import torch

from tests.harness.ranks import spawn

VOCAB, PADDED = 13, 16  # 3 padding ids, all on rank 1's shard


def _inputs():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, PADDED, generator=generator)
    logits[..., VOCAB:] = 7.0  # padding rows must not count even with large logits
    targets = torch.randint(0, VOCAB, (2, 5), generator=generator)
    return logits, targets


def _loss(logp, entropy):
    return (logp * torch.arange(1.0, 6.0)).sum() + 0.3 * entropy.sum()


def _worker(rank, world_size, tmp_dir):
    import torch.distributed as dist

    from megatron_async_rl.algorithms.logprobs import vocab_parallel_logprobs

    group = dist.new_group([0, 1])
    logits, targets = _inputs()
    shard = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(shard, targets, tp_group=group, vocab_size=VOCAB)
    _loss(logp, entropy).backward()
    return logp.detach(), entropy.detach(), shard.grad


def test_tp2_matches_single_rank(tmp_path):
    from megatron_async_rl.algorithms.logprobs import vocab_parallel_logprobs

    logits, targets = _inputs()
    full = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_logprobs(full, targets, tp_group=None, vocab_size=VOCAB)
    _loss(logp, entropy).backward()
    results = spawn(_worker, 2, tmp_path)
    for rank, (logp_r, entropy_r, grad_r) in enumerate(results):
        torch.testing.assert_close(logp_r, logp.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(entropy_r, entropy.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(grad_r, full.grad.chunk(2, dim=-1)[rank], rtol=0, atol=1e-6)
