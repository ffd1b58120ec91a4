"""The generate role on an engine-host rank: prompts to scored samples, validation passes.

Owned here: `GenerateSide`, its stages as methods `StepWork -> StepWork` (`load`, `generate`,
`score`) plus `validate`, `build_generate_side` (dataset, reward, validator and engine from
the recipe) and `build_engine` (the engine stack: SGLang inside `RestartingEngine`). When each
stage runs, and how weights reach the engine, is the loops' business (`jobs/grpo_sync.py`,
`jobs/grpo_async.py`, `jobs/generate_pipeline.py`); this class never waits for anything.

The dataset and its cursor live here only: the rank that draws a step's prompts records where
they started (`StepWork.cursor`). Every engine host draws the same prompts from the same seeded
dataset and samples its share (`served_prompts`, one share per engine, not per rank: an engine of
`engine.tp_size` spans that many ranks).

Refill (`algorithm.refill`, `rollout/refill.py`): after the reward stage a step's round is
settled (`round_flags`, then `settle`): the hosts agree on which groups were informative, keep
the first ones up to `rollout.num_prompts_per_step`, and either complete the step's batch or draw
the next round's prompts right after the last (every host the same, so the cursors agree).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING

from megatron_async_rl.engines.protocol import ManagedEngine
from megatron_async_rl.engines.recovery import prefixes
from megatron_async_rl.rewards.registry import safe_reward
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.rollout.dataset import PromptDataset, encode_prompt
from megatron_async_rl.rollout.generation import as_result, generate_samples, served_prompts
from megatron_async_rl.rollout.refill import (
    LocalRounds,
    RefillPlan,
    StoreRounds,
    informative_groups,
    wait_for_round,
)
from megatron_async_rl.rollout.validation import Validator

if TYPE_CHECKING:
    from megatron_async_rl.engines.config import SGLangEngineConfig
    from megatron_async_rl.engines.recovery.restarting import RestartingEngine
    from megatron_async_rl.engines.sglang.engine import HostLaunch

logger = logging.getLogger(__name__)

PAD_WARN_EVERY = 10
"""Steps between two warnings that refill ran out of rounds and padded the batch."""


class GenerateSide:
    """One engine and what feeds it: dataset, reward, validator (on an engine-host rank)."""

    def __init__(self, cfg, engine, tokenizer, dataset, reward, validator, engine_index: int,
                 num_engines: int, multi_turn=None, rounds=None):  # fmt: skip
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.multi_turn = multi_turn
        """`rollout.agentic.MultiTurnRollout` when the recipe has an `environment:`."""
        self.dataset, self.reward, self.validator = dataset, reward, validator
        self.engine_index, self.num_engines = engine_index, num_engines
        self.faults = None
        """Injected faults (`jobs.faults.RankFaults`: `reward_fault(step)`, `take_metrics()`),
        set by the job when the recipe asks for some."""
        self._cut_lock = threading.Lock()
        self._cut = False
        self._generating_step: int | None = None
        """The step of the generation in progress, None when none is (read by `cut`)."""
        self.trace = None
        """The rank's `TraceRecorder`, set by the job: multi-turn environment spans go there."""
        if rounds is None and num_engines == 1:
            rounds = LocalRounds()
        self.rounds = rounds
        """Refill: how the engine hosts agree on a round's flags (`rollout.refill.Rounds`)."""
        self._announced: set[int] = set()
        self._posted: tuple[int, int] | None = None
        self._quiet_until = 0

    # -- stages ----------------------------------------------------------------------------
    def load(self, step: int) -> StepWork:
        """dataloader: the step's prompts, and where in the data they start."""
        cursor = self.dataset.cursor.state_dict()
        records = self.dataset.next_batch(self.cfg.rollout.num_prompts_per_step)
        algo, plan = self.cfg.algorithm, None
        if algo.refill:
            plan = RefillPlan(self.cfg.rollout.num_prompts_per_step, 1 + algo.max_refill_rounds,
                              algo.refill_exhausted == "pad")  # fmt: skip
        return StepWork(step=step, cursor=cursor, records=records, refill=plan)

    def generate(self, work: StepWork) -> StepWork:
        """generate: this engine's share of the step's prompts (with refill: of the round in
        progress), sampled. A work whose samples are prefixes (`work.partial`: cut for a save,
        or saved so) continues from them; a prefix older than the step's staleness window is
        generated again (counted). Returns with `work.partial` set when `cut` stopped it (the
        samples hold the prefixes)."""
        cfg, records = self.cfg, work.records
        mine = self._share(work.round_start, len(records))
        if self.multi_turn is not None:
            return self._generate_trajectories(work, mine)
        ids = {i: records[i].prompt_ids or self.encode(records[i]) for i in mine}
        # A request cut short keeps its prefix if it is in the step's window.
        oldest = max(0, work.step - cfg.scheduler.generate_ahead_steps)
        if isinstance(self.engine, ManagedEngine):  # a restart budget counts steps
            self.engine.set_step(work.step, oldest)
        kept = self._prefixes(work, oldest)
        for attempt in range(1, 4):
            with self._cut_lock:
                self._generating_step, self._cut = work.step, False
            try:
                work.samples = generate_samples(
                    self.engine, self.tokenizer, records, ids, mine,
                    cfg.algorithm.num_samples_per_prompt, cfg.rollout, step=work.step,
                    run_seed=cfg.seed, prefixes=kept,
                )  # fmt: skip
            finally:
                with self._cut_lock:
                    self._generating_step, cut = None, self._cut
            cut_short = [s for s in work.samples if s.finish_reason not in prefixes.FINISHED]
            work.partial = bool(cut_short)
            if not cut_short or cut:
                return work
            # Aborted, but not by `cut` (nothing here asks for it): never train a cut response.
            logger.warning("step %d: %d response(s) came back cut short (attempt %d); "
                           "continuing them", work.step, len(cut_short), attempt)  # fmt: skip
            kept = {r.rid: r for r in (as_result(s, work.step) for s in work.samples)}
        raise RuntimeError(
            f"generate rank (engine {self.engine_index}), step {work.step}: the engine aborted "
            f"{len(cut_short)} response(s) on 3 attempts in a row (e.g. {cut_short[0].uid}), "
            "and nothing asked it to; see the engine's log"
        )

    def _generate_trajectories(self, work: StepWork, mine: list[int]) -> StepWork:
        """generate, multi-turn: whole trajectories (`rollout.agentic`). Cut (a save), the
        step's trajectories are dropped (`work.partial`, no samples) and generated again."""
        from megatron_async_rl.rollout.multiturn import Cut

        cfg, records = self.cfg, work.records
        ids = {i: self.multi_turn.encode(records[i], self.tokenizer,
                                         cfg.rollout.use_chat_template) for i in mine}  # fmt: skip
        if isinstance(self.engine, ManagedEngine):
            self.engine.set_step(work.step, max(0, work.step - cfg.scheduler.generate_ahead_steps))
        with self._cut_lock:
            self._generating_step, self._cut = work.step, False

        def cut_asked() -> bool:
            with self._cut_lock:
                return self._cut

        try:
            work.samples, sums = self.multi_turn.samples(
                self.engine, self.tokenizer, records, ids, mine,
                cfg.algorithm.num_samples_per_prompt, cfg.rollout, step=work.step,
                run_seed=cfg.seed, should_stop=cut_asked, trace=self.trace,
            )  # fmt: skip
        except Cut:
            work.samples, work.partial = [], True
            work.report.add_sums({"multiturn/trajectories_dropped_by_cut": 1.0})
            return work
        finally:
            with self._cut_lock:
                self._generating_step = None
        work.partial = False
        work.report.add_sums(sums)
        return work

    def _share(self, start: int, stop: int) -> list[int]:
        """This engine's prompts among records[start:stop] (round robin from `start`)."""
        return [start + i for i in served_prompts(stop - start, self.engine_index,
                                                  self.num_engines)]  # fmt: skip

    # -- refill ----------------------------------------------------------------------------
    def round_flags(self, work: StepWork) -> dict[int, bool] | None:
        """Refill, after the reward stage: this host's flags of the round posted, and every
        host's flags of it, or None while some are missing (a guard may call it again). A
        resumed host first posts its share of the step's rounds decided before the save: a
        host that had not read them yet waits for them."""
        plan, size = work.refill, self.cfg.rollout.num_prompts_per_step
        if work.step not in self._announced:
            for index, flags in enumerate(plan.round_flags):
                mine = set(self._share(index * size, (index + 1) * size))
                self.rounds.post(work.step, index, {i: f for i, f in flags.items() if i in mine})
            self._announced = {s for s in self._announced if s >= work.step - 1} | {work.step}
        if self._posted != (work.step, plan.rounds):  # a guard asks again and again
            flags = informative_groups(work.samples, self.cfg.algorithm.num_samples_per_prompt)
            self.rounds.post(work.step, plan.rounds, flags)
            self._posted = (work.step, plan.rounds)
        return self.rounds.gather(work.step, plan.rounds)

    def wait_round(self, work: StepWork, timeout_s: float) -> dict[int, bool]:
        """`round_flags`, waiting for the other hosts (the synchronous loop)."""
        flags = self.round_flags(work)
        if flags is not None:
            return flags
        return wait_for_round(self.rounds, work.step, work.refill.rounds, timeout_s,
                              f"generate rank (engine {self.engine_index})")  # fmt: skip

    def settle(self, work: StepWork, flags: dict[int, bool]) -> bool:
        """Refill: round `work.refill.rounds` decided from every host's `flags`. True: the
        batch is complete (`work.samples`: this host's share of it, prompts renumbered in draw
        order); False: the next round's prompts were drawn (`work.records`, `round_start`)."""
        plan, size = work.refill, self.cfg.rollout.num_prompts_per_step
        expected = set(range(work.round_start, len(work.records)))
        if set(flags) != expected:
            raise RuntimeError(
                f"generate rank (engine {self.engine_index}), step {work.step}: the refill flags "
                f"of round {plan.rounds} cover prompts {sorted(set(flags) ^ expected)} wrongly "
                f"(the round holds prompts {work.round_start}..{len(work.records) - 1})"
            )
        decision = plan.decide(flags)
        holding, pool = plan.holding(), (work.held or []) + work.samples
        held = [s for s in pool if s.prompt_index in holding]
        dropped = [s for s in pool if s.prompt_index not in holding]
        tokens = {"dynamic_sampling/response_tokens_sampled":
                  float(sum(len(s.response_ids) for s in work.samples))}  # fmt: skip
        if decision.done:
            order = plan.batch_order()
            new_index = {old: new for new, old in enumerate(order)}
            dropped += [s for s in held if s.prompt_index not in new_index]
            batch = [s for s in held if s.prompt_index in new_index]
            for sample in batch:
                sample.prompt_index = new_index[sample.prompt_index]
            work.samples = sorted(batch, key=lambda s: (s.prompt_index, s.sample_index))
            work.records, work.held, work.round_start = [work.records[i] for i in order], None, 0
            work.report.add_means(plan.metrics())
            if decision.exhausted:
                self._warn_padded(work.step, plan)
        else:
            work.held, work.samples = held, []
            work.round_start = len(work.records)
            work.records = work.records + self.dataset.next_batch(size)
        tokens["dynamic_sampling/response_tokens_dropped"] = float(
            sum(len(s.response_ids) for s in dropped)
        )
        work.report.add_sums(tokens)
        return decision.done

    def _warn_padded(self, step: int, plan: RefillPlan) -> None:
        if self.engine_index != 0 or step < self._quiet_until:
            return
        self._quiet_until = step + PAD_WARN_EVERY
        logger.warning(
            "step %d: refill found %d informative groups of %d in %d rounds "
            "(algorithm.max_refill_rounds = %d): the batch is padded with %d zero-variance "
            "groups, which train nothing (dynamic_sampling/groups_padded; a task too easy or too "
            "hard for the model, or a reward that ignores the response?)", step,
            len(plan.kept), plan.target, plan.rounds, plan.max_rounds - 1, plan.padded,
        )  # fmt: skip

    def cut(self, unless_step: int | None = None) -> bool:
        """Stop the generation in progress (from another thread): its responses come back as
        prefixes and `generate` returns the work partial. False when none was running, or when
        it is of step `unless_step`: the step the learner trains next (a save at the boundary
        after version v passes v), which the learner waits for anyway. Cutting that one would
        gain nothing and change the step: responses continued from their prefixes are
        prefilled again, so their log-probs (and, rarely, a sampled token) differ in the last
        bits from the uncut generation's, where at N = 0 the asynchronous loop must equal the
        synchronous one."""
        with self._cut_lock:
            if self._generating_step is None or self._generating_step == unless_step:
                return False
            self._cut = True
            # Under the lock: no next generation starts before the abort has gone out.
            self.engine.abort()
        return True

    def _prefixes(self, work: StepWork, oldest: int) -> dict:
        """The prefixes a partial `work` continues from (request id -> result); those older
        than `oldest` are dropped and counted as regenerated."""
        if not work.partial or not work.samples:
            return {}
        kept, counts = {}, {"rollout/prefix_tokens_kept": 0.0,
                            "rollout/prefix_tokens_regenerated": 0.0}  # fmt: skip
        for sample in work.samples:
            result, dropped = prefixes.kept_prefix(as_result(sample, work.step), oldest)
            counts["rollout/prefix_tokens_regenerated"] += dropped
            if result is not None:
                kept[result.rid] = result
                counts["rollout/prefix_tokens_kept"] += len(result.output_ids)
        work.report.add_sums(counts)
        return kept

    def score(self, work: StepWork) -> StepWork:
        """reward: every sample scored; the engine host's report of the step."""
        fault = self.faults.reward_fault(work.step) if self.faults is not None else None
        values = self.reward.score(work.samples, fault=fault)
        if self.multi_turn is not None:  # the environment's rewards, plus the function's
            from megatron_async_rl.rollout.agentic import mixed_reward

            weight = self.cfg.environment.reward_fn_weight
            values = [mixed_reward(s, v, weight) for s, v in zip(work.samples, values,
                                                                  strict=True)]  # fmt: skip
        for sample, value in zip(work.samples, values, strict=True):
            sample.reward = value
        work.report.add_sums(self.reward.take_metrics())
        if self.faults is not None:
            work.report.add_sums(self.faults.take_metrics())
        work.report.add_means(self.dataset.metrics())
        if isinstance(self.engine, ManagedEngine):
            work.report.add_sums(self.engine.take_metrics())
        return work

    def validate(self, version: int) -> dict[str, float]:
        """validation: the held-out set scored with the engine's current weights (`version`)."""
        return self.validator.run(self.engine, self.tokenizer, version, self.encode)

    # -- helpers ---------------------------------------------------------------------------
    def resumed_at(self, step: int) -> None:
        """The run resumed at `step`: the engine's restart window and injected faults count
        from there."""
        if isinstance(self.engine, ManagedEngine):
            self.engine.resumed_at(step)

    def encode(self, record) -> list[int]:
        return encode_prompt(record, self.tokenizer, self.cfg.rollout.use_chat_template)

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.multi_turn is not None:
            self.multi_turn.close()


def build_generate_side(
    cfg, groups, platform, tokenizer, head_start: EngineHeadStart | None = None
) -> GenerateSide | None:
    """This rank's generate side, its engine started (or adopted from `head_start`); None off
    the engine hosts (an engine follower's devices belong to its host's engine)."""
    layout, rank = groups.layout, groups.rank
    if "generate" not in groups.local_roles() or not layout.is_engine_host(rank):
        return None
    hosts = layout.engine_host_ranks()
    index, num_engines = hosts.index(rank), len(hosts)
    use_template = cfg.rollout.use_chat_template
    # Data and rewards first: a mistake in them is reported before the engine's start-up.
    dataset = PromptDataset(cfg.data, tokenizer=tokenizer, use_chat_template=use_template)
    reward = safe_reward(cfg.reward)
    multi_turn = None
    if cfg.environment.multi_turn:
        from megatron_async_rl.rollout.agentic import MultiTurnRollout

        multi_turn = MultiTurnRollout(cfg.environment)
    validator = None
    if cfg.scheduler.validation_every > 0:
        val = cfg.validation
        held_out = PromptDataset(
            val.data, tokenizer=tokenizer, use_chat_template=use_template,
            key_prefix="validation.data",
        )  # fmt: skip
        records = held_out.records[: val.num_prompts] if val.num_prompts else held_out.records
        validator = Validator(
            val, cfg.rollout, records, safe_reward(cfg.reward),
            index, num_engines, cfg.seed,
        )  # fmt: skip
    engine = build_engine(cfg, platform, layout, rank, head_start)
    rounds = None
    if cfg.algorithm.refill and num_engines > 1:
        import torch.distributed as dist

        # The world's own store (torchrun's), as the help board's: no collective, so a host
        # waiting for the others' flags never holds a checkpoint's barrier.
        store = dist.PrefixStore("refill_rounds", dist.distributed_c10d._get_default_store())
        rounds = StoreRounds(store, index, num_engines)
    return GenerateSide(
        cfg, engine, tokenizer, dataset, reward, validator, index, num_engines, multi_turn, rounds
    )


def engine_config(cfg, device_type: str) -> SGLangEngineConfig:
    """The SGLang engine's config on an engine host (`engine:`, `model.hf_path`, the MoE routing
    it returns; on a GPU, the local device its TP ranks start at)."""
    config = cfg.engine.sglang_config(cfg.model.hf_path, device_type, cfg.seed)
    config = dataclasses.replace(config, routing=routing_capture(cfg))  # MoE: routed experts
    if device_type == "cuda":  # the engine's TP ranks start at our device
        import torch

        from megatron_async_rl.distributed.platform import local_gpu

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        gpu = local_gpu(local_rank, torch.cuda.device_count())
        config.server_args.setdefault("base_gpu_id", gpu)
    return config


class EngineHeadStart:
    """An engine host rank's first engine, launched as soon as the recipe and the layout are
    known: its host imports SGLang and starts the engine (tens of seconds on CPU) while the rank
    joins the world and builds its roles. `build_engine` adopts it (`take`) when the engine's
    config is still the same (`--moe-use-upcycling` points the model elsewhere: that launch is
    killed and a new one made); `close` kills a launch nobody adopted (a run that stops first)."""

    def __init__(self, launch: HostLaunch):
        self._launch: HostLaunch | None = launch

    @classmethod
    def launch(cls, cfg, layout, rank: int, device_type: str) -> EngineHeadStart | None:
        """The head start of global rank `rank`'s engine; None where it hosts none."""
        from megatron_async_rl.engines.sglang.engine import HostLaunch

        if not layout.is_engine_host(rank):
            return None
        config = engine_config(cfg, device_type)
        return cls(HostLaunch(config, rank_in_role=layout.rank_in_role("generate", rank),
                              global_rank=rank))  # fmt: skip

    def take(self, config: SGLangEngineConfig) -> HostLaunch | None:
        """The launch, if it was made with `config` (once); None otherwise."""
        launch, self._launch = self._launch, None
        if launch is not None and launch.config != config:
            logger.info("the engine launched early has another config (model %s, now %s): "
                        "killed, starting anew", launch.config.model_path,
                        config.model_path)  # fmt: skip
            launch.kill()
            return None
        return launch

    def close(self) -> None:
        if self._launch is not None:
            self._launch.kill()
            self._launch = None


def build_engine(
    cfg, platform, layout, rank: int, head_start: EngineHeadStart | None = None
) -> RestartingEngine:
    """Engine host `rank`'s engine, started (or, with `head_start`, the one launched early):
    an SGLang engine (`engine_config`) inside a `RestartingEngine` (restart budget, watchdog,
    the recipe's engine faults, and with several engines the help board they share)."""
    from megatron_async_rl.engines.recovery.faults import EngineFaults
    from megatron_async_rl.engines.recovery.restarting import RestartingEngine
    from megatron_async_rl.engines.sglang.engine import SGLangEngine
    from megatron_async_rl.weight_sync.sinks import load_tensors

    hosts = layout.engine_host_ranks()
    index, num_engines = hosts.index(rank), len(hosts)
    config = engine_config(cfg, platform.device_type)
    rank_in_role = layout.rank_in_role("generate", rank)

    def start() -> SGLangEngine:
        launch = head_start.take(config) if head_start is not None else None
        engine = SGLangEngine(config, rank_in_role=rank_in_role, global_rank=rank, launch=launch)
        early = " (launched before the roles were built)" if launch is not None else ""
        logger.info("generate rank %d: engine up in %.1f s%s", rank_in_role, engine.startup_s,
                    early)  # fmt: skip
        return engine

    e = cfg.engine
    board = None
    if num_engines > 1 and e.reassign and e.max_restarts > 0:
        import torch.distributed as dist

        from megatron_async_rl.engines.recovery.reassign import HelpBoard

        # The world's own store (torchrun's): every engine host reaches it, no collective.
        store = dist.PrefixStore("engine_help", dist.distributed_c10d._get_default_store())
        board = HelpBoard(store, index)
    return RestartingEngine(
        start, load_tensors, where=f"generate rank in role {rank_in_role}, global rank {rank}",
        max_restarts=e.max_restarts, window_steps=e.restart_window_steps,
        health_timeout_s=e.health_timeout_s, check_every_s=e.health_check_every_s,
        faults=(
            EngineFaults(cfg.faults, rank, index, num_engines)
            if cfg.faults.engine_faults() else None
        ),
        board=board, generate_timeout_s=e.generate_timeout_s,
    )  # fmt: skip


def routing_capture(cfg):
    """What the engines return of their MoE routing (`moe.config`), or None: a dense model, or
    neither replay nor metrics asked."""
    from megatron_async_rl.engines.config import RoutingCapture
    from megatron_async_rl.models.dims import moe_layer_pattern

    args = cfg.role_megatron_args.get("train") or next(iter(cfg.role_megatron_args.values()))
    if not cfg.moe.engine_routing or not args.get("num_experts"):
        return None
    num_layers = int(args["num_layers"])
    pattern = moe_layer_pattern(args.get("moe_layer_freq") or 1, num_layers)
    return RoutingCapture(num_layers=num_layers, topk=int(args["moe_router_topk"]),
                          layers=tuple(i for i in range(num_layers) if pattern[i]),
                          num_experts=int(args["num_experts"]))  # fmt: skip
