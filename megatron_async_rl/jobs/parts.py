"""What one rank of a GRPO run is made of, built once and closed on every path.

Owned here: `RankParts` (the rank's clock, its generate side and/or learn side, the exchange
between them) and `build_parts`. Both loops (`grpo_sync.py`, `grpo_async.py`) take their parts
from here, so they differ only in schedule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.distributed import devices
from megatron_async_rl.jobs.exchange import GlooExchange
from megatron_async_rl.jobs.faults import RankFaults
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.observability.plots import plot_stage_timeline
from megatron_async_rl.observability.trace import merge_traces, write_trace
from megatron_async_rl.roles import memory
from megatron_async_rl.roles.generate import EngineHeadStart, GenerateSide, build_generate_side
from megatron_async_rl.roles.learn import LearnSide
from megatron_async_rl.roles.megatron_role import build_local_roles, role_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class RankParts:
    cfg: object
    groups: object
    clock: RankClock
    gen: GenerateSide | None
    """On an engine host only."""
    learn: LearnSide | None
    """On a rank with Megatron roles only."""
    exchange: GlooExchange
    faults: RankFaults | None = None
    """The recipe's rank, reward and weight-message faults (`faults:`), if any."""

    def write_trace(self) -> None:
        """Merge every rank's spans into trace.json and timeline.png (collective, world)."""
        groups = self.groups
        is_leader = groups.rank == groups.leader
        parts = [None] * dist.get_world_size(groups.control)
        payload = (self.clock.trace.events(), self.clock.trace.spans())
        devices.gather_object(payload, parts if is_leader else None, dst=groups.leader,
                              group=groups.control)  # fmt: skip
        if not is_leader:
            return
        run_dir = Path(self.cfg.run_dir)
        write_trace(run_dir / "trace.json", merge_traces([events for events, _ in parts]))
        spans = [span for _, rank_spans in parts for span in rank_spans]
        if spans:  # none when a resumed run had nothing left to train
            plot_stage_timeline(
                spans, run_dir / "timeline.png", title="stages per rank (trace.json)"
            )

    def close(self) -> None:
        if self.gen is not None:
            self.gen.shutdown()
        if self.learn is not None:
            self.learn.close()


def build_parts(cfg, groups, platform, head_start: EngineHeadStart | None = None) -> RankParts:
    """This rank's roles (checkpoint loaded), engine (adopted from `head_start` where it was
    launched early), sides and exchange."""
    from transformers import AutoTokenizer

    from megatron_async_rl.algorithms.minibatch import run_optimizer_steps_per_rl_step

    per_step = run_optimizer_steps_per_rl_step(cfg)
    # the lr schedule's horizon when neither --lr-decay-iters nor --train-iters sets it
    roles = build_local_roles(cfg, groups, platform, cfg.trainer.num_steps * per_step)
    for name, role in roles.items():
        path, head_std = role_checkpoint(cfg, name, role.args)
        role.load_hf_checkpoint(path, head_init_std=head_std)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    pad = tokenizer.pad_token_id
    pad = pad if pad is not None else 0
    learn = LearnSide(cfg, groups, roles, pad, tokenizer) if roles else None
    exchange = GlooExchange(groups, roles, cfg.weight_sync, platform.device())
    try:
        _warm_up(cfg, groups, roles, exchange)
        gen = build_generate_side(cfg, groups, platform, tokenizer, head_start)
    except BaseException:
        if learn is not None:
            learn.close()
        raise
    clock = RankClock(groups.rank, groups.local_roles())
    if gen is not None:
        gen.trace = clock.trace  # environment spans of multi-turn rollouts
    faults = None
    if cfg.faults.any():
        world = groups.layout.world_size
        if cfg.faults.rank_kill_steps and cfg.faults.rank_kill_rank >= world:
            raise ConfigError(
                "faults.rank_kill_rank", cfg.faults.rank_kill_rank,
                f"must be a global rank of this world (0 to {world - 1})",
            )  # fmt: skip
        hosts = groups.layout.engine_host_ranks()
        index = hosts.index(groups.rank) if gen is not None else None
        faults = RankFaults(cfg.faults, groups.rank, index, len(hosts))
        exchange.tamper = faults.tamper if gen is not None else None
        if gen is not None:
            gen.faults = faults
    return RankParts(cfg, groups, clock, gen, learn, exchange, faults)


def _warm_up(cfg, groups, roles, exchange) -> None:
    """Weight sync's communicators and buffers, before this rank's engine starts (review
    finding 8); an asynchronous engine host first checks that /dev/shm holds its staging."""
    host = "generate" in groups.local_roles() and groups.layout.is_engine_host(groups.rank)
    staging = host and cfg.scheduler.use_async_loop
    if staging:
        memory.check_shared_memory(memory.staging_bytes(cfg))
    start = time.perf_counter()
    metrics = exchange.warm_up(streaming=host and not staging and "logp" not in roles,
                               staging=staging)  # fmt: skip
    if metrics:
        logger.info(
            "weight sync warm-up (version 0, nothing loaded): %.2f s, %.3f GB, buffers kept "
            "%.1f MB", time.perf_counter() - start, metrics.get("weight_sync/GB", 0.0),
            metrics.get("weight_sync/pool_MB", 0.0),
        )  # fmt: skip
