"""`--moe-use-upcycling`'s effect: the upcycled model scores tokens as the dense one did.

Contract: a recipe on the tiny dense qwen3 model with `--moe-use-upcycling --num-experts 4
--moe-router-topk 2` and granularity 1 or 2 resolves the train role to a qwen3_moe
architecture; `upcycle.use_upcycled` (rank 0 writes, the role group's barrier) points the config
at `<run_dir>/upcycled_hf`, a sharded qwen3_moe checkpoint; a real Megatron role built from the
resolved args loads it and gives the dense model's log-probs within 1e-5 (fp32; the router's
renormalised top-k picks whole copies of the dense FFN, so the equality is exact up to
rounding), and its HF export is that checkpoint byte for byte (what weight sync and export
send). `transformers` loads the written checkpoint and gives the dense model's logits. Nothing is
faked: megatron-core on one gloo rank, transformers as the independent reference.
"""

from __future__ import annotations

import torch

from tests.harness.ranks import spawn

RECIPE = """\
run_dir: {run_dir}
model: {{hf_path: {model}}}
trainer: {{job: role_check}}
roles:
  groups: [{{roles: [train, logp, ref], num_ranks: 1}}]
megatron: {{bf16: false, lr: 1.0e-5, micro_batch_size: 2, seq_length: 64,
           transformer_impl: local}}
"""
TOLERANCE = 1e-5


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (4, 24), generator=torch.Generator().manual_seed(11))


def _worker(rank, world_size, tmp_dir, model, granularities):
    import functools

    import torch.distributed as dist

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.models import hf_checkpoint, upcycle
    from megatron_async_rl.recipe.load import resolve
    from megatron_async_rl.roles.megatron_role import MegatronRole

    platform = detect_platform("cpu", "gloo")
    out, groups = {}, None
    for granularity in (None, *granularities):
        recipe = f"{tmp_dir}/recipe-{granularity}.yaml"
        with open(recipe, "w") as f:
            f.write(RECIPE.format(run_dir=f"{tmp_dir}/run-{granularity}", model=model))
        flags = ["--moe-use-upcycling", "--num-experts", "4", "--moe-router-topk", "2",
                 "--moe-upcycling-granularity", str(granularity)]  # fmt: skip
        cfg = resolve(recipe, [], flags if granularity else [])
        layout = cfg.plan_layout(world_size)
        groups = groups or build_world_groups(layout, platform.backend)
        barrier = functools.partial(dist.barrier, group=groups.control)
        cfg = upcycle.use_upcycled(cfg, rank == 0, barrier)
        args = cfg.role_megatron_args["train"]
        role = MegatronRole("train", args, layout.parallelism["train"], groups.roles["train"],
                            platform, seed=5)  # fmt: skip
        role.load_hf_checkpoint(cfg.model.hf_path)
        logp, _ = role.logprobs(_tokens(role.spec.vocab_size), micro_batch_size=2)
        exported = role.gather_hf_state_dict()
        written = hf_checkpoint.load_hf_state_dict(cfg.model.hf_path)
        same = exported.keys() == written.keys() and all(
            torch.equal(exported[k], written[k]) for k in written
        )
        out[granularity] = {
            "path": cfg.model.hf_path, "logp": logp, "export_is_checkpoint": same,
            "num_experts": args["num_experts"], "moe_ffn": args.get("moe_ffn_hidden_size"),
            "model_type": hf_checkpoint.read_hf_config(cfg.model.hf_path)["model_type"],
        }  # fmt: skip
    return out


def _hf_logits(path: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(_tokens(model.config.vocab_size)).logits


def test_upcycled_model_gives_the_dense_log_probs(tiny_model, tmp_path):
    model = str(tiny_model("qwen3"))
    (out,) = spawn(_worker, 1, tmp_path, model, (1, 2))
    dense = out[None]
    assert dense["num_experts"] is None and dense["path"] == model
    for granularity in (1, 2):
        moe = out[granularity]
        assert moe["path"] == str(tmp_path / f"run-{granularity}" / "upcycled_hf")
        assert (moe["model_type"], moe["num_experts"]) == ("qwen3_moe", 4)
        assert moe["moe_ffn"] == 128 // granularity
        assert moe["export_is_checkpoint"], granularity
        diff = (moe["logp"] - dense["logp"]).abs().max().item()
        assert diff <= TOLERANCE, f"granularity {granularity}: max abs log-prob diff {diff}"
    reference = _hf_logits(model)
    diff = (_hf_logits(out[2]["path"]) - reference).abs().max().item()
    assert diff <= 1e-4, f"transformers on the upcycled checkpoint: max abs logit diff {diff}"
