"""The role check: every Megatron role loads the checkpoint and scores one batch; all must agree.

Owned here: a cheap pre-flight job (`trainer.job: role_check`). On every rank it builds the
roles placed there, loads the HF checkpoint (`model.hf_path` or `--load`) into each, and
computes per-token log-probs of one synthetic batch (`smoke.*` in the recipe) through each
role's own TP/PP/EP layout. Rank 0 collects one copy per role, compares them with each other and
with a `transformers` forward pass of the same checkpoint, writes `metrics.jsonl` and
`role_check.json` to the run dir, and fails the run when any pair differs by more than the
tolerance of the roles' precision (`platform.LOGPROB_TOLERANCE`; fp32 runs with TF32 off).
With `--save DIR`, the train role's weights are exported there as a HF checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_async_rl.distributed import devices
from megatron_async_rl.distributed.groups import WorldGroups
from megatron_async_rl.distributed.platform import LOGPROB_TOLERANCE, Platform, exact_fp32_matmuls
from megatron_async_rl.models import hf_checkpoint, hf_config
from megatron_async_rl.models.hf_reference import hf_logprobs
from megatron_async_rl.observability.logs import leader_print
from megatron_async_rl.recipe.schema import ResolvedConfig
from megatron_async_rl.roles.megatron_role import MegatronRole, build_local_roles

logger = logging.getLogger(__name__)


def tolerance_of(cfg: ResolvedConfig) -> float:
    """The log-prob tolerance of the roles' precision: bf16 if any role runs in bf16."""
    bf16 = any(args.get("bf16") for args in cfg.role_megatron_args.values())
    return LOGPROB_TOLERANCE["bf16" if bf16 else "fp32"]


def _batch(cfg: ResolvedConfig, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(cfg.smoke.seed)
    shape = (cfg.smoke.batch_size, cfg.smoke.seq_length)
    return torch.randint(0, vocab_size, shape, generator=generator)


def _is_reporter(role: MegatronRole) -> bool:
    """One rank per role reports: last pipeline stage, TP rank 0, DP rank 0."""
    pgc = role.pgc
    return role.is_last_stage and dist.get_rank(pgc.tp) == 0 and dist.get_rank(pgc.dp) == 0


def _compare(logps: dict[str, torch.Tensor]) -> dict[str, float]:
    names = sorted(logps)
    metrics = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            diff = (logps[a] - logps[b]).abs().max().item()
            metrics[f"logprob/{a}_vs_{b}_max_abs_diff"] = diff
    return metrics


def run_role_check(cfg: ResolvedConfig, groups: WorldGroups, platform: Platform) -> dict:
    """Run the check on every rank (collective); returns the metrics (complete on rank 0)."""
    if platform.use_cuda:
        exact_fp32_matmuls()
    rank = dist.get_rank()
    start = time.perf_counter()
    roles = build_local_roles(cfg, groups, platform)
    reports = {}
    for name, role in roles.items():
        checkpoint = role.args.get("load") or cfg.model.hf_path
        if checkpoint:
            role.load_hf_checkpoint(checkpoint)
        tokens = _batch(cfg, role.spec.vocab_size).to(platform.device())
        out = role.logprobs(tokens, micro_batch_size=int(role.args.get("micro_batch_size") or 1))
        if out is not None and _is_reporter(role):
            reports[name] = {"logp": out[0].cpu(), "entropy_mean": out[1].mean().item()}
    save = cfg.role_megatron_args.get("train", {}).get("save")
    if save and "train" in roles:
        exported = roles["train"].gather_hf_state_dict()
        if exported is not None:
            base = hf_checkpoint.read_hf_config(cfg.model.hf_path) if cfg.model.hf_path else {}
            base = hf_config.export_base(base, roles["train"].mtp_num_layers)
            hf_checkpoint.save_hf_checkpoint(save, exported, base, tokenizer_src=cfg.model.hf_path)
            logger.info("exported the train role's weights to %s", save)

    gathered = [None] * dist.get_world_size(groups.control)
    devices.gather_object(reports, gathered if rank == 0 else None, dst=0, group=groups.control)
    if rank != 0:
        return {}
    logps = {name: r["logp"] for part in gathered for name, r in part.items()}
    metrics = {"step": 0}
    if cfg.model.hf_path:
        vocab = int(hf_checkpoint.read_hf_config(cfg.model.hf_path)["vocab_size"])
        logps["hf"] = hf_logprobs(cfg.model.hf_path, _batch(cfg, vocab))
    metrics.update(_compare(logps))
    for part in gathered:
        for name, r in part.items():
            metrics[f"entropy/{name}/mean"] = r["entropy_mean"]
    metrics["timing/role_check/total_s"] = time.perf_counter() - start
    _write(cfg, metrics, groups)
    worst = max((v for k, v in metrics.items() if k.endswith("_max_abs_diff")), default=0.0)
    tolerance = tolerance_of(cfg)
    if worst > tolerance:
        raise RuntimeError(
            f"role check failed: per-token log-probs differ by {worst:.3g} > {tolerance} "
            f"between roles (see {cfg.run_dir}/role_check.json)"
        )
    return metrics


def _write(cfg: ResolvedConfig, metrics: dict, groups: WorldGroups) -> None:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(metrics) + "\n")
    report = {"layout": groups.layout.describe(), "tolerance": tolerance_of(cfg),
              "metrics": metrics}  # fmt: skip
    (run_dir / "role_check.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["role check: per-token log-probs of one batch, max abs difference"]
    lines += [f"  {k.split('/')[1]:<20} {v:.3e}" for k, v in metrics.items() if "_vs_" in k]
    leader_print("\n".join(lines))
