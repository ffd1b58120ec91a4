"""MoE auxiliary losses reach a train step's gradients as megatron-core defines them.

Contract: with a main loss of zero, the gradient `MegatronRole.train_step` leaves for a tiny
Qwen3-MoE model is the gradient of megatron-core's auxiliary loss alone, averaged over the
step's micro-batches and data-parallel ranks (the schedule's 1 / num_micro aux-loss scale and
DDP's average; the main loss's multiplication by num_micro x dp does not apply to it):
- the z-loss (--moe-z-loss-coeff c): c x the mean over a micro-batch's tokens of
  logsumexp(router logits)^2, summed over MoE layers;
- each load-balancing loss (--moe-router-load-balancing-type, --moe-aux-loss-coeff c), per layer
  c E / (k T^2) sum_e (sum_tokens softmax(logits)_e) (tokens routed to e): `aux_loss` over the
  micro-batch, `seq_aux_loss` per sequence and averaged over sequences, `global_aux_loss` with
  the routed counts summed over data-parallel ranks and averaged over the step's micro-batches so
  far (reset at each step: a second step gives the same gradient).
Reference: those formulas written out here on the router logits of `transformers`' forward pass
of the same checkpoint, differentiated by autograd; the gradients agree within 1e-5 relative
(all tensors together). The step's metrics `actor/moe/<name>` (`moe.aux_metrics`) are the same
losses without their coefficient, averaged over micro-batches and MoE layers (and each layer's
with --moe-per-layer-logging): the z-loss's averaged over data-parallel ranks, the global
load-balancing loss's ranks' partial losses summed, as megatron-core reduces it.

The tokens leave out the pad id. `transformers` builds the embedding with `padding_idx`, which
drops the pad row's gradient; megatron-core's embedding keeps it. The tiny model's pad row is all
zeros (transformers' init), where RMSNorm's backward multiplies by 1/sqrt(eps) = 1000, and again
in Qwen3's q/k norms (its q and k are zero too): a z-loss of 1e-3 (which counts every position,
pads too) on a [2, 10] batch with one pad token gives that row a gradient of norm 151, against
0.025 for the whole model without it; `transformers` gives the same 151 with padding_idx unset.

Nothing is faked: real megatron-core on gloo ranks (one; two data-parallel), real transformers.
"""

import pytest
import torch

from tests.harness.ranks import spawn

NUM_EXPERTS, TOPK = 4, 2  # tests/conftest.py's tiny qwen3_moe
TOLERANCE = 1e-5
NUM_STEPS = 2  # the second step checks that nothing carries over (global_aux_loss's counts)
# (megatron flags, load-balancing type of the reference or "z", coefficient)
CASES = {
    "z_loss": ({"moe_z_loss_coeff": 1e-3}, "z", 1e-3),
    "aux_loss": ({"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-2},
                 "aux_loss", 1e-2),
    "seq_aux_loss": ({"moe_router_load_balancing_type": "seq_aux_loss",
                      "moe_aux_loss_coeff": 1e-2}, "seq_aux_loss", 1e-2),
    "global_aux_loss": ({"moe_router_load_balancing_type": "global_aux_loss",
                         "moe_aux_loss_coeff": 1e-2}, "global_aux_loss", 1e-2),
}  # fmt: skip


def _batch(vocab_size: int) -> torch.Tensor:
    """[8, 12] tokens, none of them the pad id 0 (see the module docstring)."""
    return torch.randint(1, vocab_size, (8, 12), generator=torch.Generator().manual_seed(3))


def _rows(tokens: torch.Tensor, dp_rank: int, dp_size: int, mbs: int) -> list[torch.Tensor]:
    """This data-parallel rank's micro-batches of `tokens`."""
    return list(tokens.chunk(dp_size)[dp_rank].split(mbs))


def _aux_loss(logits_SBE: list[torch.Tensor], kind: str, coeff: float, counts=None):
    """megatron-core's auxiliary loss of one micro-batch, summed over layers. `counts[l]`: the
    tokens per expert to weigh layer l's probabilities by (global_aux_loss), else this
    micro-batch's own."""
    total = 0.0
    for layer, logits in enumerate(logits_SBE):
        seq_len, batch, _ = logits.shape
        flat = logits.reshape(-1, NUM_EXPERTS).float()
        if kind == "z":
            total = total + coeff * torch.logsumexp(flat, -1).square().mean()
            continue
        probs = torch.softmax(flat, -1)
        routed = torch.zeros_like(probs).scatter(1, probs.topk(TOPK, dim=1).indices, 1.0)
        if kind == "seq_aux_loss":  # each sequence is its own batch, then the mean over them
            probs, routed = probs.reshape(seq_len, -1), routed.reshape(seq_len, -1)
            num_tokens, num_seqs, per_expert = seq_len, batch, routed.sum(0)
        elif counts is not None:  # global_aux_loss
            num_tokens, num_seqs, per_expert = counts[layer].sum() / TOPK, 1, counts[layer]
        else:
            num_tokens, num_seqs, per_expert = flat.shape[0], 1, routed.sum(0)
        scale = NUM_EXPERTS * coeff / (TOPK * num_tokens * num_tokens * num_seqs)
        total = total + (probs.sum(0) * per_expert).sum() * scale
    return total


def _reference_grads(path: str, kind: str, coeff: float, dp_size: int, mbs: int) -> dict:
    """d/dθ of the step's auxiliary loss (mean over micro-batches and ranks), in HF names."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens = _batch(model.config.vocab_size)
    per_rank = [_rows(tokens, r, dp_size, mbs) for r in range(dp_size)]
    logits = [[_router_logits(model, mb) for mb in rank] for rank in per_rank]
    num_micro = len(per_rank[0])
    loss, running = 0.0, None
    for m in range(num_micro):
        counts = None
        if kind == "global_aux_loss":  # counts summed over ranks, averaged over micro-batches
            step = [
                torch.stack([_routed_counts(layer) for layer in logits[r][m]])
                for r in range(dp_size)
            ]
            running = sum(step) if running is None else running + sum(step)
            counts = running / (m + 1)
        for r in range(dp_size):
            loss = loss + _aux_loss(logits[r][m], kind, coeff, counts) / (num_micro * dp_size)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads)]
    return _per_expert_names(dict(zip(params, grads))), float(loss.detach())


def _per_expert_names(grads: dict) -> dict:
    """transformers' fused expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]) under
    the checkpoint's per-expert names, as the exporter writes them."""
    out = {}
    for name, grad in grads.items():
        prefix, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for e, expert in enumerate(grad):
                gate, up = expert.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
        elif kind == "down_proj" and name.endswith("experts.down_proj"):
            out.update({f"{prefix}.{e}.down_proj.weight": g for e, g in enumerate(grad)})
        else:
            out[name] = grad
    return out


def _router_logits(model, tokens_BT: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's router logits [S, B, E] (megatron-core's token order)."""
    batch, seq_len = tokens_BT.shape
    out = model(tokens_BT, output_router_logits=True)
    return [x.reshape(batch, seq_len, -1).transpose(0, 1) for x in out.router_logits]


def _routed_counts(logits_SBE: torch.Tensor) -> torch.Tensor:
    flat = logits_SBE.detach().reshape(-1, NUM_EXPERTS)
    top = torch.softmax(flat.float(), -1).topk(TOPK, dim=1).indices
    return torch.zeros_like(flat).scatter(1, top, 1.0).sum(0)


def _padded_batch(vocab_size: int) -> torch.Tensor:
    """`_batch` right-padded as the rollout batches are: row i ends in i % 4 pad ids (0)."""
    tokens = _batch(vocab_size)
    for row in range(tokens.shape[0]):
        if row % 4:
            tokens[row, -(row % 4):] = 0
    return tokens


def _masked_z_reference(path: str, coeff: float, mbs: int) -> dict:
    """d/dθ of the step's z-loss over the valid tokens only (megatron-core's `z_loss_func`
    with a padding mask: the mean of logsumexp^2 over a micro-batch's valid tokens), in HF
    names; the pad positions come after each row's tokens, so nothing valid attends to them."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    micro = _rows(_padded_batch(model.config.vocab_size), 0, 1, mbs)
    loss = 0.0
    for tokens in micro:
        valid_SB = (tokens != 0).transpose(0, 1)
        for logits in _router_logits(model, tokens):
            lse2 = torch.logsumexp(logits.float(), -1).square()
            loss = loss + coeff * (lse2 * valid_SB).sum() / valid_SB.sum() / len(micro)
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params.values(), grads)]
    return _per_expert_names(dict(zip(params, grads)))


def _worker(rank, world_size, tmp_dir, path, case_flags, mbs, padded=False):
    """A train role over all ranks (data-parallel); NUM_STEPS steps on the same micro-batches,
    with lr 0 (the weights stay, so every step must give the same gradient) and no clipping;
    each step's gradients in HF names (rank 0)."""
    import torch.distributed as dist

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    layout = plan_layout(
        world_size, [RoleGroupSpec(["train"], num_ranks=world_size)], {"train": Parallelism(1, 1)}
    )
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    args = {**role_args(path), **case_flags, "lr": 0.0, "min_lr": 0.0, "clip_grad": 0.0}
    role = MegatronRole("train", args, Parallelism(1, 1), groups.roles["train"], platform, seed=5)
    role.load_hf_checkpoint(path)
    tokens = (_padded_batch if padded else _batch)(role.spec.vocab_size)
    dp_rank, dp_size = dist.get_rank(role.pgc.dp), dist.get_world_size(role.pgc.dp)
    micro = [{"tokens": t} for t in _rows(tokens, dp_rank, dp_size, mbs)]
    if padded:  # as roles/learn.py passes it: rollout.batch.padding_BT
        assert role.mask_moe_padding
        for mb in micro:
            mb["padding"] = mb["tokens"] == 0
    steps, metrics = [], []
    for _ in range(NUM_STEPS):
        # A main loss of zero: the step's gradient is the auxiliary losses' alone.
        metrics.append(role.train_step(micro, lambda logp, entropy, mb: (0.0 * logp.sum(), {})))
        grads = {name: p.main_grad.clone() for name, p in role.module.named_parameters()}
        steps.append(grads)
    with torch.no_grad():  # the gradients in HF names: the exporter's own name and layout map
        params = dict(role.module.named_parameters())
        hf_steps = []
        for grads in steps:
            for name, grad in grads.items():
                params[name].copy_(grad)
            hf_steps.append(role.gather_hf_state_dict())
    return hf_steps, metrics


def _check(hf_steps: list[dict], reference: dict, label: str) -> None:
    for step, grads in enumerate(hf_steps):
        assert grads.keys() == reference.keys(), label
        err = sum(float((grads[name] - ref).square().sum()) for name, ref in reference.items())
        norm = sum(float(ref.square().sum()) for ref in reference.values())
        relative = (err / norm) ** 0.5
        assert relative <= TOLERANCE, f"{label} step {step}: relative error {relative:.3g}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_aux_loss_gradient_of_a_train_step_matches_the_formula_on_transformers(
    case, tiny_model, tmp_path
):
    flags, kind, coeff = CASES[case]
    path = str(tiny_model("qwen3_moe"))
    hf_steps, metrics = spawn(_worker, 1, tmp_path, path, {**flags, "moe_per_layer_logging": True},
                              2)[0]  # fmt: skip
    reference, loss = _reference_grads(path, kind, coeff, dp_size=1, mbs=2)
    _check(hf_steps, reference, case)
    # The logged loss (Megatron-LM's): without its coefficient, the mean over micro-batches
    # and over the MoE layers; with --moe-per-layer-logging each layer's too.
    name = {"z": "z_loss"}.get(kind, kind.replace("aux_loss", "load_balancing_loss"))
    name = name if name.startswith(("z", "seq", "global")) else "load_balancing_loss"
    for step in metrics:
        layers = [step[k] for k in step if k.startswith(f"actor/moe/{name}/layer_")]
        assert len(layers) == 2 and step[f"actor/moe/{name}"] == pytest.approx(sum(layers) / 2)
        assert step[f"actor/moe/{name}"] == pytest.approx(loss / coeff / 2, rel=1e-5), step


@pytest.mark.parametrize("case", ["z_loss", "global_aux_loss"])
def test_aux_loss_gradient_is_averaged_over_data_parallel_ranks(case, tiny_model, tmp_path):
    flags, kind, coeff = CASES[case]
    path = str(tiny_model("qwen3_moe"))
    hf_steps, metrics = spawn(_worker, 2, tmp_path, path, flags, 2)[0]
    reference, loss = _reference_grads(path, kind, coeff, dp_size=2, mbs=2)
    _check(hf_steps, reference, case)
    # the z-loss: the data-parallel mean; the global load-balancing loss as megatron-core
    # reduces it, its ranks' partial losses (computed with the global counts) summed
    name, ranks = ("z_loss", 1) if kind == "z" else ("global_load_balancing_loss", 2)
    assert metrics[0][f"actor/moe/{name}"] == pytest.approx(ranks * loss / coeff / 2, rel=1e-5)


def test_pad_positions_are_left_out_of_the_z_loss(tiny_model, tmp_path):
    """A right-padded batch with its padding mask (`rollout.batch.padding_BT`): the z-loss
    gradient is that over the valid tokens alone. Without the mask, the pads' zero embedding
    rows give a gradient thousands of times larger (module docstring)."""
    flags, _, coeff = CASES["z_loss"]
    path = str(tiny_model("qwen3_moe"))
    hf_steps, _ = spawn(_worker, 1, tmp_path, path, flags, 2, True)[0]
    _check(hf_steps, _masked_z_reference(path, coeff, mbs=2), "z_loss with pads")
