"""Scalar heads on Megatron GPT models reproduce `transformers` classifiers and export back exactly.

Contract: for tiny Llama and Qwen3 critics (`*ForTokenClassification`) and reward models
(`*ForSequenceClassification`), one label each and pad_token_id 0, written by `transformers`
itself, a role with a "value" head gives per-token values within 1e-4 max abs of
`logits[..., 0]`, and one with a "score" head the score at each row's last non-pad token within
1e-4 of `logits[:, 0]` (fp32, right-padded batches), under TP=1, TP=2 and PP=2. Gathering the
sharded model back gives the checkpoint's tensors (`score.weight`, `score.bias` included) byte for
byte, and the exported directory loads into `transformers` with the same outputs. A critic
started from the policy's causal-LM checkpoint with head_init_std 0 has a zero head (values 0)
and the policy's body. One value train step gives the same head gradient, loss and grad norm
under TP=2 as under TP=1 (the replicated head needs no TP reduction and must add none); the head's
sequence-parallel path (its output all-gathered, its gradient summed over TP) gives the
one-process head's output and gradients. Nothing is faked: real megatron-core on gloo ranks,
real transformers (run before any Megatron state exists in the test process).
"""

import pytest
import torch

from tests.harness.heads import (
    LENGTHS,
    PAD_ID,
    check_export,
    check_heads,
    head_outputs,
    head_tokens,
    hf_scores,
    hf_values,
)
from tests.harness.ranks import spawn
from tests.harness.roles import role_args

FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="module")
def checkpoints(tiny_model):
    """{family: {"value": critic, "score": reward model, "policy": causal LM}} directories."""
    from megatron_async_rl.models import hf_checkpoint

    out = {}
    for family in FAMILIES:
        out[family] = {
            "value": str(tiny_model(family, task="token_classification")),
            "score": str(tiny_model(family, task="sequence_classification")),
            "policy": str(tiny_model(family)),
        }
        assert hf_checkpoint.read_hf_config(out[family]["score"])["pad_token_id"] == PAD_ID
    return out


def _layout_worker(rank, world_size, tmp_dir, paths, role_parallel):
    """[train (ranks 0-1), logp (ranks 2-3)] with `role_parallel`; `head_outputs` of each."""
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec

    args = {role: role_args(paths["value"], **par) for role, par in role_parallel.items()}
    specs = [RoleGroupSpec(roles=[role], num_ranks=2) for role in role_parallel]
    layout = plan_layout(
        world_size, specs, {role: Parallelism.from_megatron_args(a) for role, a in args.items()}
    )
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend)
    role = layout.roles_of_rank(rank)[0]
    par, role_groups = layout.parallelism[role], groups.roles[role]
    return head_outputs(role, args[role], par, role_groups, platform, paths)


def _tp1_worker(rank, world_size, tmp_dir, checkpoints):
    """Every family on one rank (TP=1, a train role), and a critic from the policy."""
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole

    platform = detect_platform("cpu", "gloo")
    par = Parallelism(1, 1)
    layout = plan_layout(1, [RoleGroupSpec(roles=["train"], num_ranks=1)], {"train": par})
    groups = build_world_groups(layout, platform.backend)
    out = {}
    for family, paths in checkpoints.items():
        args = role_args(paths["value"])
        out[family] = head_outputs("train", args, par, groups.roles["train"], platform, paths)
        critic = MegatronRole("ref", args, par, groups.roles["train"], platform, 5, head="value")
        critic.load_hf_checkpoint(paths["policy"], head_init_std=0.0)
        head = critic.module.output_layer
        out[family]["from_policy"] = {
            "weight": head.weight.detach().clone(),
            "bias": head.bias.detach().clone(),
            "values": critic.values(head_tokens(critic.spec.vocab_size), micro_batch_size=4),
            "export": critic.gather_hf_state_dict(),
        }
    return out


def _check_step(step: dict, reference: dict, label: str) -> None:
    """A value step's head gradients, loss and grad norm equal the TP=1 step's."""
    for key in ("weight_grad", "bias_grad"):
        torch.testing.assert_close(step[key], reference[key], rtol=1e-4, atol=1e-7, msg=label)
    for key in ("actor/grad_norm", "value_loss"):
        got, want = step["metrics"][key], reference["metrics"][key]
        assert abs(got - want) <= 1e-4 * abs(want), f"{label} {key}: {got} vs TP=1 {want}"


@pytest.fixture(scope="module")
def references(checkpoints):
    """`transformers` outputs, computed in this process before any rank starts."""
    return {
        family: {"values": hf_values(p["value"]), "scores": hf_scores(p["score"])}
        for family, p in checkpoints.items()
    }


@pytest.fixture(scope="module")
def tp1_results(checkpoints, references, tmp_path_factory):
    (results,) = spawn(_tp1_worker, 1, tmp_path_factory.mktemp("tp1"), checkpoints)
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_values_and_scores_match_transformers(family, checkpoints, references, tp1_results):
    result = tp1_results[family]
    reference = references[family]
    check_heads(result, reference["values"], reference["scores"], f"{family} TP=1")
    check_export(result["value_export"], checkpoints[family]["value"])
    check_export(result["score_export"], checkpoints[family]["score"])
    # the loss is a sum over real values, the head's gradient not zero: the step saw them
    assert result["step"]["metrics"]["value_loss"] > 0
    assert result["step"]["weight_grad"].abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_critic_from_policy_checkpoint_gets_zero_head(family, checkpoints, tp1_results):
    from megatron_async_rl.models import hf_checkpoint

    start = tp1_results[family]["from_policy"]
    assert torch.equal(start["weight"], torch.zeros_like(start["weight"]))
    assert torch.equal(start["bias"], torch.zeros(1))
    assert start["values"].shape == (len(LENGTHS), max(LENGTHS))
    assert torch.equal(start["values"], torch.zeros_like(start["values"]))
    policy = hf_checkpoint.load_hf_state_dict(checkpoints[family]["policy"])
    exported = start["export"]
    assert exported.keys() == (policy.keys() - {"lm_head.weight"}) | {"score.weight", "score.bias"}
    for name, tensor in policy.items():
        if name != "lm_head.weight":
            assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_pp2_heads_match_transformers_and_export_round_trips(
    family, checkpoints, references, tp1_results, tmp_path
):
    from megatron_async_rl.models import hf_checkpoint

    paths = checkpoints[family]
    layouts = {
        "train": {"tensor_model_parallel_size": 2},
        "logp": {"pipeline_model_parallel_size": 2},
    }
    results = spawn(_layout_worker, 4, tmp_path, paths, layouts)
    values_ref, scores_ref = references[family]["values"], references[family]["scores"]
    # last stages: both TP ranks of train, the second stage of logp
    assert [r["values"] is not None for r in results] == [True, True, False, True]
    for rank, r in enumerate(results):
        if r["values"] is not None:
            label = f"{family} {'TP=2' if r['role'] == 'train' else 'PP=2'} rank {rank}"
            check_heads(r, values_ref, scores_ref, label)
    exports = [r for r in results if r["value_export"] is not None]
    assert [r["role"] for r in exports] == ["train", "logp"]  # each role's first rank
    for r in exports:
        check_export(r["value_export"], paths["value"])
        check_export(r["score_export"], paths["score"])
    for rank in (0, 1):  # both TP ranks hold the head: each has the TP=1 gradient
        _check_step(results[rank]["step"], tp1_results[family]["step"], f"{family} TP=2 {rank}")

    # the export (of the TP=2 role) loads into transformers and gives the same outputs
    for kind, hf_outputs, reference in (("value", hf_values, values_ref),
                                        ("score", hf_scores, scores_ref)):  # fmt: skip
        out = tmp_path / f"export-{kind}"
        hf_checkpoint.save_hf_checkpoint(
            out, exports[0][f"{kind}_export"], hf_checkpoint.read_hf_config(paths[kind]),
            tokenizer_src=paths[kind],
        )  # fmt: skip
        assert torch.equal(hf_outputs(str(out)), reference), kind


def _sequence_parallel_worker(rank, world_size, tmp_dir, sequence_parallel):
    """The head alone over 2 TP ranks against the same head on the whole sequence."""
    import torch.distributed as dist

    from megatron_async_rl.models.heads import ScalarHead

    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(7)
    hidden_sbh = torch.randn(8, 3, 16, generator=generator)
    grad_sb1 = torch.randn(8, 3, 1, generator=generator)
    head = ScalarHead(
        16, bias=True, dtype=torch.float32, sequence_parallel=sequence_parallel,
        tp_group=group, init_std=0.5, seed=1,
    )  # fmt: skip
    with torch.no_grad():
        head.bias.fill_(0.25)
    weight = head.weight.detach().clone().requires_grad_()
    bias = head.bias.detach().clone().requires_grad_()
    whole = hidden_sbh.clone().requires_grad_()
    reference = torch.nn.functional.linear(whole, weight, bias)
    (reference * grad_sb1).sum().backward()

    local = hidden_sbh.chunk(2)[rank] if sequence_parallel else hidden_sbh
    local = local.clone().requires_grad_()
    out, out_bias = head(local)
    (out * grad_sb1).sum().backward()
    reduced = [head.weight.grad.clone(), head.bias.grad.clone()]
    for param, grad in zip(head.parameters(), reduced):
        # what finalize_model_grads does under sequence parallelism for such parameters
        if sequence_parallel and getattr(param, "sequence_parallel", False):
            dist.all_reduce(grad, group=group)
    want_input = whole.grad.chunk(2)[rank] if sequence_parallel else whole.grad
    return {
        "out_bias": out_bias,
        "output": (out - reference).abs().max().item(),
        "input_grad": (local.grad - want_input).abs().max().item(),
        "weight_grad": (reduced[0] - weight.grad).abs().max().item(),
        "bias_grad": (reduced[1] - bias.grad).abs().max().item(),
        "marked": [getattr(p, "sequence_parallel", None) for p in head.parameters()],
    }


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_replicated_head_gradients_over_tensor_parallel_ranks(sequence_parallel, tmp_path):
    results = spawn(_sequence_parallel_worker, 2, tmp_path, sequence_parallel)
    for result in results:
        assert result["out_bias"] is None
        assert result["marked"] == [sequence_parallel, sequence_parallel]
        diffs = {k: result[k] for k in ("output", "input_grad", "weight_grad", "bias_grad")}
        assert max(diffs.values()) <= 1e-6, diffs
