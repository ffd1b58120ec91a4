"""Multi-token prediction (--mtp-num-layers) inside a rank: the micro-batches, a train role with
MTP layers, a step that returns its gradients, and the plain-autograd reference the gradients
are checked against (`tests/distributed/test_mtp.py`'s docstring defines it); used by the MTP
tests in tests/distributed and by `tests/gpu/test_mtp_cuda.py`.
"""

from __future__ import annotations

import torch

from tests.harness.roles import one_window_roles

NUM_MTP, FACTOR = 2, 0.3


def mtp_micro_batches() -> list[dict]:
    """Two micro-batches of 2 x 12 tokens (seed 7): a 4-token prompt, row 1 of 8 real tokens."""
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, 96, (4, 12), generator=generator)
    padding = torch.zeros(4, 12, dtype=torch.bool)
    padding[1, 8:] = True  # a sample of 8 real tokens
    mask = (~padding[:, 1:]).float()
    mask[:, :3] = 0.0  # a 4-token prompt
    return [{"tokens": tokens[i : i + 2], "mask": mask[i : i + 2], "padding": padding[i : i + 2]}
            for i in (0, 2)]  # fmt: skip


def mtp_role(path: str, mtp: dict | None, name: str = "train"):
    """Role `name` on one rank (lr 1e-3, no clipping) with the MTP flags `mtp` (None: none)."""
    extra = {"lr": 1e-3, "clip_grad": 0.0, **(mtp or {})}
    return one_window_roles(name, 1, path, {}, extra=extra)[0][name]


def _rl_loss(logp, mask, total):
    return -(logp * mask).sum() / total


def mtp_step(role, micro: list[dict], total=None) -> tuple[dict, list, dict]:
    """Metrics, the RL loss's log-probs per micro-batch, and every parameter's gradient;
    `total`: the RL loss's token count (default: `micro`'s)."""
    total = sum(mb["mask"].sum() for mb in micro) if total is None else total
    seen = []

    def loss_fn(logp, entropy, batch):
        seen.append(logp.detach().clone())
        loss = _rl_loss(logp, batch["mask"], total)
        return loss, {"loss": loss.detach()}

    metrics = role.train_step(micro, loss_fn)
    grads = {n: p.main_grad.clone() for n, p in role.chunks[0].named_parameters()}
    return metrics, seen, grads


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _inner_layer(mtp_layer):
    """An MTP layer's transformer layer (megatron-core 0.19 names it `mtp_model_layer`)."""
    if hasattr(mtp_layer, "mtp_model_layer"):
        return mtp_layer.mtp_model_layer
    return mtp_layer.transformer_layer


def mtp_reference(model, micro: list[dict], vocab: int):
    """(gradients of the reference loss, each MTP layer's cross-entropy averaged over the
    micro-batches) by plain autograd; see `tests/distributed/test_mtp.py`'s docstring."""
    params = dict(model.named_parameters())
    eps, out_w = model.config.layernorm_epsilon, model.output_layer.weight
    if model.share_embeddings_and_output_weights:
        out_w = model.shared_embedding_or_output_weight()
    total = sum(mb["mask"].sum() for mb in micro)
    loss, ce_means = 0.0, torch.zeros(NUM_MTP)
    for mb in micro:
        tokens, padding = mb["tokens"], mb["padding"]
        b, t = tokens.shape
        captured = {}
        hook = model.decoder.register_forward_hook(
            lambda m, a, kw, out, into=captured: into.update(out=out, kw=kw), with_kwargs=True
        )
        positions = torch.arange(t).expand(b, t)
        logits = model(tokens, positions, attention_mask=None)  # no hook: the main head only
        hook.remove()
        logp = logits[:, :-1, :vocab].log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
        loss = loss + _rl_loss(logp, mb["mask"], total)
        hidden, ids = captured["out"], tokens
        for k, layer in enumerate(model.mtp.layers):
            ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)  # t + k + 1
            emb = model.embedding.word_embeddings.weight[ids].transpose(0, 1)
            joined = torch.cat(
                [_rms(emb, layer.enorm.weight, eps), _rms(hidden, layer.hnorm.weight, eps)], -1
            )
            out, _ = _inner_layer(layer)(
                hidden_states=joined @ layer.eh_proj.weight.T, attention_mask=None,
                rotary_pos_emb=captured["kw"]["rotary_pos_emb"],
            )  # fmt: skip
            hidden = _rms(out, layer.final_layernorm.weight, eps)
            logits_k = (hidden @ out_w.T).transpose(0, 1)[:, : t - k - 2, :vocab]
            target, real = tokens[:, k + 2 :], ~padding[:, k + 2 :]
            ce = -logits_k.log_softmax(-1).gather(-1, target[..., None])[..., 0]
            ce_mean = (ce * real).sum() / real.sum()
            ce_means[k] += ce_mean.detach() / len(micro)
            loss = loss + FACTOR / NUM_MTP * ce_mean / len(micro)
    grads = torch.autograd.grad(loss, list(params.values()))
    return dict(zip(params, grads, strict=True)), ce_means


def reference_worker(rank, world_size, tmp_dir, path):
    """One step of a one-rank MTP role: its gradients and metrics beside `mtp_reference`'s."""
    role = mtp_role(path, {"mtp_num_layers": NUM_MTP, "mtp_loss_scaling_factor": FACTOR})
    micro = mtp_micro_batches()
    ref_grads, ref_ce = mtp_reference(role.chunks[0], micro, role.spec.vocab_size)
    metrics, _, grads = mtp_step(role, micro)
    return {"grads": grads, "ref_grads": ref_grads, "ref_ce": ref_ce, "metrics": metrics}


def embedding_copies(role) -> list:
    """Every pipeline stage's word embedding, on each rank (pipeline-collective): the first
    stage's, and the MTP stage's copy where it has one (in its last model chunk)."""
    from megatron_async_rl.models.shards import mtp_embedding_copy

    own = next((c for c in map(mtp_embedding_copy, role.chunks) if c is not None), None)
    if own is None and role.chunks[0].pre_process:
        own = role.chunks[0].embedding.word_embeddings.weight
    copies = [None] * torch.distributed.get_world_size(role.pgc.pp)
    torch.distributed.all_gather_object(
        copies, None if own is None else own.detach().clone(), group=role.pgc.pp
    )
    return [c for c in copies if c is not None]
