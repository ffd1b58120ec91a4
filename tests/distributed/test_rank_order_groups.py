"""--use-tp-pp-dp-mapping on real groups: a role's groups hold Megatron-LM's ranks, its log-probs
still match `transformers`.

Contract: a train role of pp=2 x dp=2 on 4 gloo ranks, built with --use-tp-pp-dp-mapping from its
command-line flag, gets tp, pp, dp, model-parallel and embedding groups holding the ranks
megatron-core's `RankGenerator` gives for Megatron-LM's order with the flag ('tp-cp-ep-pp-dp':
pipeline stages (0, 1) and (2, 3), not the default's (0, 2) and (1, 3)); the weight-sync senders
of the layout are the ranks its groups put at (tp, dp) = 0 of each stage; the log-probs each last
stage computes for a batch match `transformers`' within 1e-4 (fp32), and the gathered HF state
dict is byte-identical to the checkpoint. A TP=2 checkpoint of `checkpoint.megatron_state` loads
into PP=2 x DP=2 with the flag bit for bit, and the next step equals the default order's within
1e-6. Nothing is faked: real megatron-core, real transformers.
"""

import torch

from tests.harness.checkpoints import load_worker, save_worker
from tests.harness.ranks import spawn

TOLERANCE = 1e-4


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))


def _worker(rank, world_size, tmp_dir, path):
    import torch.distributed as dist

    from megatron_async_rl.config.megatron import parse
    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    flags = ["--use-tp-pp-dp-mapping", "--pipeline-model-parallel-size", "2"]
    args = {**role_args(path), **parse.parse_megatron_flags(flags)}
    par = Parallelism.from_megatron_args(args)
    layout = plan_layout(world_size, [RoleGroupSpec(["train"], num_ranks=world_size)],
                         {"train": par})  # fmt: skip
    platform = detect_platform("cpu", "gloo")
    groups = build_world_groups(layout, platform.backend, role_args={"train": args})
    role = MegatronRole("train", args, par, groups.roles["train"], platform, seed=5)
    role.load_hf_checkpoint(path)
    pgc = role.pgc
    members = {
        name: tuple(dist.get_process_group_ranks(getattr(pgc, name)))
        for name in ("tp", "pp", "dp", "mp", "embd", "intra_dist_opt")
    }
    coords = {name: dist.get_rank(getattr(pgc, name)) for name in ("tp", "pp", "dp")}
    out = role.logprobs(_tokens(role.spec.vocab_size), micro_batch_size=2)
    return {
        "members": members,
        "coords": coords,
        "senders": layout.grid("train").sender_ranks(),
        "logp": None if out is None else out[0],
        "exported": role.gather_hf_state_dict(),
    }


def test_groups_follow_megatron_lm_order_and_logprobs_match_transformers(tiny_model, tmp_path):
    import transformers
    from megatron.core.parallel_state import RankGenerator

    from megatron_async_rl.models import hf_checkpoint

    path = str(tiny_model("llama"))
    results = spawn(_worker, 4, tmp_path, path)

    ranks = RankGenerator(tp=1, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-pp-dp")  # Megatron-LM's
    expected = {name: ranks.get_ranks(token) for name, token in
                (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("mp", "tp-pp"))}  # fmt: skip
    assert expected["pp"] == [[0, 1], [2, 3]]  # not the default order's [[0, 2], [1, 3]]
    for rank, result in enumerate(results):
        for name, enumeration in expected.items():
            assert list(result["members"][name]) in enumeration, (rank, name)
            assert rank in result["members"][name]
        assert result["members"]["embd"] == result["members"]["pp"]  # first and last stage
        assert result["members"]["intra_dist_opt"] == (0, 1, 2, 3)
    stage_firsts = [r for r, res in enumerate(results) if res["coords"]["tp"] == 0
                    and res["coords"]["dp"] == 0]  # fmt: skip
    assert results[0]["senders"] == tuple(stage_firsts) == (0, 1)

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        logits = model(tokens).logits
    reference = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    last_stages = [r for r, res in enumerate(results) if res["logp"] is not None]
    assert last_stages == [1, 3]  # pp rank 1 of each data-parallel replica
    for rank in last_stages:
        diff = (results[rank]["logp"] - reference).abs().max().item()
        assert diff <= TOLERANCE, (rank, diff)

    original = hf_checkpoint.load_hf_state_dict(path)
    exported = [r["exported"] for r in results if r["exported"] is not None]
    assert len(exported) == 1
    assert exported[0].keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[0][name], tensor), name


def test_checkpoint_resumes_into_the_tp_pp_dp_order(tiny_model, tmp_path):
    """A TP=2 checkpoint (`checkpoint.megatron_state`) loads into PP=2 x DP=2 with the flag as
    in the default order: the loaded weights are the saved ones bit for bit, and the next step
    gives what it gives in the default order (both replicas train on the same batch here, so
    not the uninterrupted 2-rank run's step)."""
    path, ckpt = str(tiny_model("llama")), str(tmp_path / "ckpt")
    for name in ("save", "default", "flag"):
        (tmp_path / name).mkdir()
    saved = spawn(save_worker, 2, tmp_path / "save", path, ckpt)
    at_save = next(r for r in saved if r[0] is not None)[0]
    after = {}
    for name, flag in (("default", False), ("flag", True)):
        parallel = {"pipeline_model_parallel_size": 2, "use_tp_pp_dp_mapping": flag}
        loaded = spawn(load_worker, 4, tmp_path / name, path, ckpt, parallel)
        weights, after[name], _ = next(r for r in loaded if r[0] is not None)
        for key, tensor in at_save.items():
            assert torch.equal(weights[key], tensor), (name, key)
    worst = max((after["flag"][k] - after["default"][k]).abs().max().item() for k in at_save)
    moved = max((after["flag"][k] - at_save[k]).abs().max().item() for k in at_save)
    assert worst <= 1e-6 and moved > 1e-4, (worst, moved)
