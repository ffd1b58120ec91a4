"""vocab_parallel_logprobs on one rank equals log_softmax + gather and the entropy formula.

Contract: log p(target) and H = -sum p log p per position, in fp32, with Megatron's padded
vocabulary rows excluded from the softmax; gradients flow. Nothing is faked (no process group:
tp_group=None is the single-rank path). The TP=2 path is checked in tests/distributed.
"""

import torch

from megatron_async_rl.algorithms.logprobs import vocab_parallel_logprobs


def test_matches_log_softmax_and_entropy_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 5))
    logp, entropy = vocab_parallel_logprobs(logits, targets, tp_group=None, vocab_size=11)
    reference = torch.log_softmax(logits, dim=-1)
    expected_logp = reference.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(reference.exp() * reference).sum(-1)
    torch.testing.assert_close(logp, expected_logp.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, expected_entropy.float(), rtol=0, atol=1e-6)


def test_padded_vocab_rows_are_excluded():
    torch.manual_seed(1)
    real = torch.randn(2, 4, 7)
    padded = torch.cat([real, torch.full((2, 4, 9), 5.0)], dim=-1)  # 9 padding ids, large logits
    targets = torch.randint(0, 7, (2, 4))
    logp, entropy = vocab_parallel_logprobs(padded, targets, tp_group=None, vocab_size=7)
    logp_ref, entropy_ref = vocab_parallel_logprobs(real, targets, tp_group=None, vocab_size=7)
    torch.testing.assert_close(logp, logp_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, entropy_ref, rtol=0, atol=1e-6)


def test_gradient_matches_autograd_of_log_softmax():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 6, requires_grad=True)
    targets = torch.randint(0, 6, (2, 3))
    logp, entropy = vocab_parallel_logprobs(logits, targets, tp_group=None, vocab_size=6)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref = torch.log_softmax(logits, dim=-1)
    ref_loss = ref.gather(-1, targets.unsqueeze(-1)).sum() + 0.1 * (-(ref.exp() * ref).sum())
    ref_loss.backward()
    torch.testing.assert_close(grad, logits.grad, rtol=1e-5, atol=1e-6)
