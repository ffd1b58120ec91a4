"""Entry point: `torchrun ... -m megatron_async_rl.train --config RECIPE [--set k=v] [-- flags]`.

Resolve the recipe (a bad one exits with code 2 and one line naming the key, the value and the
rule, before any process group exists), carve the world into role groups, run the job, and close
the process group on success and on error. Jobs (`trainer.job`): `grpo`, the RL loop
(`jobs/grpo_sync.py` at `generate_ahead_steps: 0`, else the asynchronous `jobs/grpo_async.py`),
and `role_check`, where every Megatron role loads the checkpoint and scores one batch through
its own layout (`jobs/role_check.py`).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from pathlib import Path

from megatron_async_rl.checkpoint.config import (
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    Interrupted,
    Preempted,
)
from megatron_async_rl.cli import parse_command_line
from megatron_async_rl.config.errors import (
    ConfigError,
    exit_on_config_error,
    first_report_on_node,
    reported_on_node,
)
from megatron_async_rl.jobs import preflight
from megatron_async_rl.models import upcycle
from megatron_async_rl.observability.logs import leader_print, setup_logging
from megatron_async_rl.observability.quiet import quiet_known_noise
from megatron_async_rl.recipe.load import resolve
from megatron_async_rl.recipe.tree import RESOLVED_NAME, write_resolved

logger = logging.getLogger("megatron_async_rl.train")


def _platform(cfg):
    from megatron_async_rl.distributed.platform import detect_platform

    try:
        return detect_platform(cfg.platform.device, cfg.platform.backend)
    except ValueError as err:
        where = f"{cfg.platform.device}/{cfg.platform.backend}"
        raise ConfigError("platform", where, str(err)) from None


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()  # before megatron-core and SGLang are imported
    setup_logging()
    cli = parse_command_line(sys.argv[1:] if argv is None else argv)
    # A dry run may check a cluster recipe where its checkpoint is absent (one warning).
    sets = [*cli.sets, *([f"checkpoint.resume={cli.resume}"] if cli.resume else [])]
    cfg = exit_on_config_error(
        resolve, cli.config, sets, cli.megatron_argv, cli.run_dir, not cli.dry_run or cli.here
    )
    world_size = cli.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    ranks_per_node = cli.ranks_per_node or (int(local_world) if local_world else None)
    layout = exit_on_config_error(cfg.plan_layout, world_size, ranks_per_node)
    if cli.dry_run:
        from megatron_async_rl.checkpoint.store import check_resume_matches

        exit_on_config_error(check_resume_matches, cfg)
        exit_on_config_error(preflight.check_run_inputs, cfg, cli.here)
        exit_on_config_error(preflight.check_batches, cfg, layout)
        device, backend = cfg.platform.device, cfg.platform.backend
        auto = " (auto: cuda/nccl where a GPU is visible)" if "auto" in (device, backend) else ""
        from megatron_async_rl.algorithms import passes
        from megatron_async_rl.roles import memory

        memory_lines = memory.describe(
            memory.plan_memory(cfg, layout), cfg.engine.mem_fraction_static or 0.8,
            memory.saved(cfg, layout),
        )  # fmt: skip
        leader_print(
            f"recipe {cli.config}: valid for {world_size} ranks on platform {device}/{backend}"
            f"{auto}\n{layout.describe()}\n{memory_lines}"
            + (f"\n{passes.describe(cfg)}" if cfg.trainer.job == "grpo" else "")
        )
        return 0
    platform = exit_on_config_error(_platform, cfg)
    exit_on_config_error(
        preflight.check_platform_dtype, cfg, "cuda" if platform.use_cuda else "cpu"
    )

    head_start = _engine_head_start(cfg, layout, platform)
    try:
        return _run_world(cfg, layout, platform, head_start)
    finally:
        if head_start is not None:
            head_start.close()  # a run that stopped before its engine was adopted


def _engine_head_start(cfg, layout, platform):
    """On an engine host rank, its engine launched now (`roles.generate.EngineHeadStart`), so
    that SGLang starts while the rank joins the world and builds its roles; None elsewhere, and
    where `--moe-use-upcycling` will point the model at a checkpoint not yet written."""
    if cfg.trainer.job != "grpo" or "RANK" not in os.environ:
        return None
    if upcycle.plan_of(cfg.role_megatron_args) is not None:
        return None
    from megatron_async_rl.roles.generate import EngineHeadStart

    return EngineHeadStart.launch(cfg, layout, int(os.environ["RANK"]), platform.device_type)


def _run_world(cfg, layout, platform, head_start) -> int:
    import torch.distributed as dist

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.platform import init_distributed

    timeout_s, timeout_key = cfg.collective_timeout_s()
    start_up_s = cfg.startup_timeout_s()  # barriers that wait for engines
    rank, world_size = init_distributed(platform, timeout_s=start_up_s)
    try:
        setup_logging(rank, layout.roles_of_rank(rank))
        logger.info("layout on %d ranks (%s):\n%s", world_size, platform, layout.describe())
        logger.info("collectives fail after %g s (%s; world and control groups %g s)",
                    timeout_s, timeout_key, start_up_s)  # fmt: skip
        groups = build_world_groups(
            layout, platform.backend, datetime.timedelta(seconds=timeout_s),
            control_timeout=datetime.timedelta(seconds=start_up_s),
            role_args=cfg.role_megatron_args, device=platform.device(),
        )  # fmt: skip
        if rank == 0:
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            write_resolved(cfg, Path(cfg.run_dir) / RESOLVED_NAME)
        try:
            # --moe-use-upcycling: rank 0 writes the MoE checkpoint every role and engine loads
            cfg = upcycle.use_upcycled(cfg, rank == 0, lambda: dist.barrier(group=groups.control))
            _run_job(cfg, groups, platform, head_start)
        except ConfigError as err:  # found at run time: a checkpoint, a plugin, /dev/shm, ...
            if err.rank_local or first_report_on_node(str(err)):  # by whichever rank found it
                where = f"[global rank {rank}] " if err.rank_local else ""
                sys.stderr.write(f"error: {where}{err}\n")
                sys.stderr.flush()
            return 2
        except Interrupted:
            leader_print(f"interrupted (Ctrl-C): checkpoint saved, outputs in {cfg.run_dir}; "
                         "the same command resumes", rank)  # fmt: skip
            _end_now(_stop_exit(rank, "INTERRUPTED", INTERRUPTED_EXIT_CODE, "interrupted"))
        except KeyboardInterrupt:  # a second Ctrl-C, or one before the loop took the signal
            if first_report_on_node("interrupted"):
                sys.stderr.write("interrupted (Ctrl-C): stopped at once, without a checkpoint; "
                                 f"outputs so far in {cfg.run_dir}\n")  # fmt: skip
            _end_now(_stop_exit(rank, "INTERRUPTED", INTERRUPTED_EXIT_CODE, "interrupted"))
        except Preempted as stop:
            leader_print(f"preempted ({stop}): checkpoint saved; exit {PREEMPTED_EXIT_CODE}", rank)
            _end_now(_stop_exit(rank, "PREEMPTED", PREEMPTED_EXIT_CODE, str(stop)))
        except Exception:
            if reported_on_node():  # a peer printed why the run stops; this is its echo
                logger.debug("stopping after a peer's error", exc_info=True)
                return 1
            raise
        dist.barrier(group=groups.control)
        leader_print(f"done: outputs in {cfg.run_dir}", rank)
    finally:
        dist.destroy_process_group()
    return 0


def _end_now(code: int) -> None:
    """End a run stopped on a signal or Ctrl-C: its outputs are written and its engines shut
    down, but threads of the asynchronous loop may still wait in collectives whose peers have
    stopped (an engine host's weight receiver waits for a version that will not come). Tearing
    the interpreter down under them aborts the process ("terminate called without an active
    exception", SIGABRT), so the process ends here, after flushing its logs."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stop_exit(rank: int, kind: str, code: int, text: str) -> int:
    """The ranks' exit code after a stop of `kind` (INTERRUPTED: Ctrl-C, 130; PREEMPTED: a
    save-and-exit signal, 83). Under a launcher (MEGATRON_ASYNC_RL_<kind>_FILE set) rank 0
    leaves that marker, which the launcher turns into `code`, and every rank exits 0, so
    torchrun ends quietly instead of reporting failed workers (or restarting them, with
    --max-restarts); under plain torchrun, `code`."""
    marker = os.environ.get(f"MEGATRON_ASYNC_RL_{kind}_FILE")
    if not marker:
        return code
    if rank == 0:
        Path(marker).write_text(f"{text}\n")
    return 0


def _run_job(cfg, groups, platform, head_start=None) -> None:
    if cfg.trainer.job == "grpo":
        if cfg.scheduler.use_async_loop:
            from megatron_async_rl.jobs.grpo_async import run_grpo_async as run_grpo
        else:
            from megatron_async_rl.jobs.grpo_sync import run_grpo_sync as run_grpo

        run_grpo(cfg, groups, platform, head_start)
    else:
        from megatron_async_rl.jobs.role_check import run_role_check

        run_role_check(cfg, groups, platform)


def _main_interruptible() -> int:
    """`main`, with a Ctrl-C outside the loop's handling (start-up, a dry run) reported in one
    line and exit 130 instead of a traceback per rank."""
    try:
        return main()
    except KeyboardInterrupt:
        if first_report_on_node("interrupted"):
            sys.stderr.write("interrupted (Ctrl-C) before the run started\n")
        return INTERRUPTED_EXIT_CODE


if __name__ == "__main__":
    sys.exit(_main_interruptible())
