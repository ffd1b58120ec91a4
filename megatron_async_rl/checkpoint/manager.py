"""Saving and resuming a run: when, what, in which order, on which ranks.

Owned here: `CheckpointManager` (built by a loop on every rank with the world's groups):
`choose()` before anything is built (the newest complete checkpoint, a given one, or none; a
checkpoint of another recipe is an error there), `restore(...)` once the roles and engines are
up, `due(v)`, `boundary(v)` (save now? stop after?), `save(v, gen, learn)` at a step
boundary, and the signal flag (`SignalFlag`) that turns SIGTERM / SIGUSR1 into a save at the
next boundary and the `Preempted` exit. Called by `jobs/grpo_sync.py` and `jobs/grpo_async.py` (with
`jobs/async_checkpoint.py`). Every call is collective over the world (`groups.control`, and
dist_checkpointing's default group).

Save of version v (after its weight sync, every rank at the boundary):
1. the leader (global rank 0, which holds the train role) clears `.partial_step_v`; barrier;
2. every rank writes `rank_<r>.pt` there, and all write the train role's model and optimizer
   into its `megatron/` (dist_checkpointing); barrier;
3. the leader checksums the files, writes the manifest last, renames the directory to
   `step_v` (`store.publish`) and deletes checkpoints beyond `keep_last`; barrier.
A crash anywhere before the rename leaves only a partial directory, which resume ignores.

Resume of version v: the train role's model and optimizer from `megatron/` (any layout), then
one weight sync of v to the logp role and the engines (they start from the HF checkpoint), the
ref role from its source; each rank's pipeline state (`pipeline_state`); the loop continues at
step v. The leader rewrites `metrics.jsonl` without the steps >= v a crashed run may have
logged (`MetricsWriter.truncate_from`), and the prompt ledger likewise; a run that finds no
complete checkpoint drops every step an earlier attempt logged.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_async_rl.checkpoint import megatron_state, pipeline_state, store
from megatron_async_rl.checkpoint.config import Interrupted, Preempted
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.distributed import devices

logger = logging.getLogger(__name__)


class SignalFlag:
    """Set by the configured save-and-exit signals and by Ctrl-C (SIGINT), in the main thread;
    every rank asks every other at a step boundary whether any got one (`any_rank`).

    Ctrl-C stops like a save-and-exit signal (save at the next boundary, then stop) but is
    reported as an interruption (exit 130). A second Ctrl-C, more than `REPEAT_S` after the
    first, stops at once (KeyboardInterrupt, caught by the entry point: no checkpoint). One
    within `REPEAT_S` is the same keypress reaching the rank twice (from the terminal and again
    from torchrun's agent) and is ignored."""

    REPEAT_S = 1.0
    STOP, SAVE = 1, 2
    """`any_rank`'s answer: 0 none, STOP Ctrl-C only, SAVE a save-and-exit signal or deadline."""

    def __init__(self, names: list[str], exit_after_s: float | None = None):
        self.raised: str | None = None
        self.deadline = None if exit_after_s is None else time.monotonic() + exit_after_s
        """Megatron's --exit-duration-in-mins: past it, the run saves and stops as on a signal."""
        self._interrupted_at: float | None = None
        for name in names:
            signal.signal(getattr(signal, name), self._on_signal)
        signal.signal(signal.SIGINT, self._on_interrupt)  # never a save_on_signal name

    def _on_signal(self, signum, frame) -> None:
        self.raised = signal.Signals(signum).name
        logger.warning("%s received: saving at the next step boundary, then exiting", self.raised)

    def _on_interrupt(self, signum, frame) -> None:
        now = time.monotonic()
        if self._interrupted_at is not None:
            if now - self._interrupted_at > self.REPEAT_S:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            return
        self._interrupted_at = now
        self.raised = self.raised or "SIGINT"
        log = logger.warning if os.environ.get("RANK", "0") == "0" else logger.debug
        log("Ctrl-C: saving at the next step boundary, then stopping "
                       "(Ctrl-C again to stop at once, without a checkpoint)")  # fmt: skip

    def code(self) -> int:
        if not self.raised and self.deadline is not None and time.monotonic() > self.deadline:
            self.raised = "--exit-duration-in-mins"
            logger.warning("%s passed: saving at this step boundary, then exiting", self.raised)
        if not self.raised:
            return 0
        return self.STOP if self.raised == "SIGINT" else self.SAVE

    def any_rank(self, group) -> int:
        """The strongest reason any rank has to stop (collective): 0, STOP or SAVE."""
        flag = torch.tensor([self.code()])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


class CheckpointManager:
    def __init__(self, cfg, groups):
        self.cfg, self.groups = cfg, groups
        self.config = cfg.checkpoint
        self.resume = self.config.resume  # auto, never or a path (`--resume`)
        self.root = Path(self.config.path(cfg.run_dir))
        self.is_leader = groups.rank == 0
        self.keys = store.compatibility_keys(cfg)
        minutes = cfg.role_megatron_args.get("train", {}).get("exit_duration_in_mins")
        self.signals = SignalFlag(self.config.save_on_signal, minutes and minutes * 60.0)
        self.interrupted = False
        """Whether the stop agreed at the last boundary came from Ctrl-C alone."""
        self.chosen: tuple = (None, None)
        self.writer = megatron_state.AsyncWriter() if self.config.async_save else None
        self.in_flight: tuple[int, float] | None = None
        """(version, start) of the save being written in the background."""
        self.ready: dict[str, float] = {}
        self.final = False
        self.restored: dict | None = None
        """This rank's saved state after `restore` (None: nothing resumed, or another world
        size saved it)."""
        if "train" not in groups.layout.roles_of_rank(0):
            raise ConfigError(
                "roles.groups", [list(w.roles) for w in groups.layout.windows],
                "checkpoints need the train role on global rank 0 (megatron-core's "
                "dist_checkpointing writes the common part of the state from rank 0)",
                hint="put the group with train first",
            )  # fmt: skip

    # -- when ------------------------------------------------------------------------------
    def due(self, version: int) -> bool:
        """`checkpoint.every_steps` (versions), or Megatron-LM's --save-interval N (the
        optimizer-step count reaches a multiple of N at this version)."""
        every = self.config.every_steps
        return (every > 0 and version % every == 0) or self._crossed("save_interval", version)

    def export_due(self, version: int) -> bool:
        every = self.config.hf_export_every
        return every > 0 and version % every == 0

    def export_hf(self, version: int, learn) -> None:
        """The train role's weights as a HF checkpoint `hf_step_<version>`, and with PPO the
        critic's as a `*ForTokenClassification` one, `hf_step_<version>_critic` (collective over
        each role's ranks; the others return at once)."""
        from megatron_async_rl.models import heads, hf_checkpoint, hf_config

        hf_path = self.cfg.model.hf_path
        roles = learn.roles if learn is not None else {}
        if "train" in roles and (exported := roles["train"].gather_hf_state_dict()) is not None:
            path = self.root / f"hf_step_{version:08d}"
            base = hf_checkpoint.read_hf_config(hf_path) if hf_path else {}
            base = hf_config.export_base(base, roles["train"].mtp_num_layers)
            hf_checkpoint.save_hf_checkpoint(path, exported, base, tokenizer_src=hf_path)
            logger.info("exported the train role's weights at v%d to %s", version, path)
        if "critic" in roles and (exported := roles["critic"].gather_hf_state_dict()) is not None:
            source = hf_path if self.cfg.critic.init == "policy" else self.cfg.critic.init
            path = self.root / f"hf_step_{version:08d}_critic"
            base = heads.hf_head_config(hf_checkpoint.read_hf_config(source), "value")
            hf_checkpoint.save_hf_checkpoint(path, exported, base, tokenizer_src=hf_path)
            logger.info("exported the critic's weights at v%d to %s", version, path)

    def preempted(self) -> bool:
        """Whether any rank got a save-and-exit signal or Ctrl-C (collective); which one is
        `stop_error`'s."""
        code = self.signals.any_rank(self.groups.control)
        self.interrupted = code == SignalFlag.STOP
        return code > 0

    def stop_error(self, version: int) -> Preempted:
        """What a loop raises after the save at a boundary where the run stops on a signal."""
        if self.interrupted:
            return Interrupted(f"Ctrl-C at version {version}")
        return Preempted(f"a save-and-exit signal at version {version}")

    def _crossed(self, dest: str, version: int) -> bool:
        """Whether the optimizer-step count (version x optimizer steps per RL step) reaches a
        multiple of the train role's Megatron arg `dest` at `version` (the same on every
        rank: a function of the version)."""
        interval = self.cfg.role_megatron_args.get("train", {}).get(dest)
        if not interval or version < 1:
            return False
        from megatron_async_rl.algorithms.minibatch import run_optimizer_steps_per_rl_step

        per_step = run_optimizer_steps_per_rl_step(self.cfg)
        return version * per_step // interval > (version - 1) * per_step // interval

    def exit_interval_reached(self, version: int) -> bool:
        """Megatron-LM's --exit-interval N: save and stop once the optimizer-step count
        reaches a multiple of N."""
        if not self._crossed("exit_interval", version):
            return False
        logger.warning("--exit-interval reached at v%d: saving, then exiting", version)
        return True

    def boundary(self, version: int) -> tuple[bool, bool]:
        """At the boundary after version `version` (collective): (save now, then stop). A
        background write that has ended everywhere is published here (at the last version or
        on a signal: waited for); its metrics wait in `take_metrics`."""
        preempted = self.preempted() | self.exit_interval_reached(version)
        last = version == self.cfg.trainer.num_steps
        self.final = preempted or last  # the run stops here: nothing is left in the background
        if self.in_flight is not None:
            self.ready.update(self._finish(blocking=self.final))
        return preempted or (last and self.config.save_at_end) or self.due(version), preempted

    def take_metrics(self) -> dict[str, float]:
        """`checkpoint/*` of saves published since the last call."""
        out, self.ready = self.ready, {}
        return out

    # -- save ------------------------------------------------------------------------------
    def save(self, version: int, gen, learn, pending=None, extra=None) -> dict[str, float]:
        """Write checkpoint `version` (collective; `pending` and `extra`: an asynchronous
        engine host's `PendingSteps` and validation state); returns `checkpoint/*` metrics.

        With `async_save` the model and optimizer are written by a forked process after the
        snapshot and the checkpoint is published at a later boundary (at the boundary where
        the run stops: before return); a save while the previous one is still being written
        waits for it first."""
        start = time.perf_counter()
        metrics = self._finish(blocking=True) if self.in_flight is not None else {}
        staged = store.partial_dir(self.root, version)
        if self.is_leader:
            store.remove_partials(self.root)
            staged.mkdir(parents=True)
        dist.barrier(group=self.groups.control)
        torch.save(
            pipeline_state.rank_state(version, gen, learn, pending, extra),
            staged / f"rank_{self.groups.rank:05d}.pt",
        )
        train = learn.roles.get("train") if learn is not None else None
        megatron_state.save_train_state(train, staged / "megatron", self.writer)
        if "critic" in self.groups.layout.parallelism:  # PPO's value model, written at once
            critic = learn.roles.get("critic") if learn is not None else None
            megatron_state.save_train_state(critic, staged / "critic")
        self.in_flight = (version, start)
        if self.writer is None or self.final:
            metrics.update(self._finish(blocking=True))
        metrics["checkpoint/stall_s"] = time.perf_counter() - start
        return metrics

    def _finish(self, blocking: bool) -> dict[str, float]:
        """Publish the save in flight once every rank's files are written (collective): the
        leader checksums them, writes the manifest and renames the directory."""
        timeout = self.cfg.scheduler.stage_timeout_s
        if self.writer is not None and not self.writer.finish(blocking, self.groups.control,
                                                              timeout):  # fmt: skip
            return {}
        version, start = self.in_flight
        self.in_flight = None
        dist.barrier(group=self.groups.control)
        size = 0
        if self.is_leader:
            manifest = store.Manifest(
                step=version, world_size=dist.get_world_size(),
                recipe_hash=store.recipe_hash(self.keys), recipe_keys=self.keys, files={},
                extra={"layout": self.groups.layout.describe(), "saved_at": time.time()},
            )  # fmt: skip
            path = store.publish(self.root, version, manifest)
            size = sum(s for s, _ in manifest.files.values())
            for old in store.prune(self.root, self.config.keep_last):
                logger.info("checkpoint %s deleted (keep_last %d)", old, self.config.keep_last)
            logger.info("checkpoint v%d saved: %s (%.1f MB)", version, path, size / 2**20)
        dist.barrier(group=self.groups.control)
        return {"checkpoint/save_s": time.perf_counter() - start, "checkpoint/bytes": float(size),
                "checkpoint/version": float(version)}  # fmt: skip

    def close(self) -> None:
        """Stop a background write left unfinished (an error ended the run: its partial
        directory is ignored by resume), and the writer's results queue."""
        if self.writer is not None and self.in_flight is not None:
            self.writer.close()
        megatron_state.stop_write_queue()

    # -- resume ----------------------------------------------------------------------------
    def _choose(self) -> tuple[str | None, dict | None]:
        """(path, manifest) of the checkpoint to resume from, decided on the leader."""
        if self.resume == "never":
            return None, None
        if self.resume == "auto":
            found = store.find_resumable(self.root)
            return (str(found[0]), found[1].__dict__) if found else (None, None)
        manifest, problem = store.verify(Path(self.resume))
        if manifest is None:
            raise ConfigError("--resume", self.resume, f"not a complete checkpoint: {problem}")
        return self.resume, manifest.__dict__

    def choose(self) -> None:
        """Decide what to resume from (collective; before the roles and engines are built, so
        that a checkpoint of another recipe stops the run at once)."""
        box: list = [None]
        if self.is_leader:
            try:
                box[0] = ("ok", *self._choose())
            except ConfigError as err:
                box[0] = ("error", err.key, err.value, err.rule)
        devices.broadcast_object_list(box, src=0, group=self.groups.control)
        if box[0][0] == "error":
            raise ConfigError(*box[0][1:])
        _, path, manifest = box[0]
        if path is not None:
            store.check_same_recipe(path, manifest["recipe_keys"], self.keys)
        self.chosen = (path, manifest)

    def restore(self, gen, learn, exchange) -> int:
        """Resume from the checkpoint `choose` found, if any; returns the first step to run
        (collective)."""
        path, manifest = self.chosen
        if path is None:  # a first start, or a restart before any checkpoint was complete
            dropped = _truncate_logs(learn, 0)
            if dropped:
                logger.warning(
                    "no complete checkpoint in %s: starting at step 0; dropped the %d step "
                    "record(s) an earlier attempt logged in %s", self.root, dropped,
                    self.cfg.run_dir,
                )  # fmt: skip
            return 0
        version, path = int(manifest["step"]), Path(path)
        train = learn.roles.get("train") if learn is not None else None
        megatron_state.load_train_state(train, path / "megatron")
        if "critic" in self.groups.layout.parallelism:
            critic = learn.roles.get("critic") if learn is not None else None
            megatron_state.load_train_state(critic, path / "critic")
        exchange.weights_ready()
        exchange.sync_weights(version, gen.engine if gen is not None else None)
        if learn is not None:
            learn.weights_synced(version)
        same_world = manifest["world_size"] == dist.get_world_size()
        own = path / f"rank_{self.groups.rank:05d}.pt"
        state = torch.load(own, weights_only=False) if same_world else None
        cursor = None
        if gen is not None:
            saved = state["gen"] if state is not None else _any_cursor(path)["gen"]
            # another world size: where the version's prompts start (older checkpoints: cursor)
            cursor = (
                saved["cursor"]
                if state is not None
                else saved.get("version_cursor", saved["cursor"])
            )
        pipeline_state.restore_rank_state(state, cursor, gen, learn)
        if gen is not None:
            gen.resumed_at(version)
        self.restored = state
        if state is None:
            pipeline_state.reseed(self.cfg.seed, version, self.groups.rank)
        if learn is not None:
            dropped = _truncate_logs(learn, version)
            learn.pending_metrics.update({
                "resume/from_step": float(version), "resume/same_world": float(same_world),
                "resume/records_dropped": float(dropped),
            })  # fmt: skip
        logger.info(
            "resumed from %s at version %d (same world size: %s)", path, version, same_world
        )
        return version


def _truncate_logs(learn, version: int) -> int:
    """The leader drops what earlier attempts logged for steps >= `version` (metrics.jsonl,
    TensorBoard, the ledger): the run logs them again. Returns the metrics records dropped."""
    if learn is None or learn.writer is None:
        return 0
    if learn.ledger is not None:
        learn.ledger.truncate_from(version)
    return learn.writer.truncate_from(version)


def _any_cursor(path: Path) -> dict:
    for file in sorted(path.glob("rank_*.pt")):
        state = torch.load(file, weights_only=False)
        if "gen" in state:
            return state
    raise RuntimeError(f"checkpoint {path} has no engine host's prompt cursor")
