"""Stand-ins for the in-process pipeline tests (`test_async_pipeline.py` and its kin).

- `TimedEngine`: `FakeEngine` whose generation takes time, token by token, so a weight update
  can land mid-sequence (tokens after it carry the new version), a pause holds generation and
  an abort cuts it (the responses come back as prefixes, "abort").
  Like SGLang it refuses `flush_cache` while a request is running, while paused, or during a
  weight update ("requests in flight"). Its real twin, SGLang, runs in tests/e2e and
  tests/distributed/test_sglang_engine.py.
- `FakeLearner`: the learn side's stage methods without a model (`roles/learn.py:LearnSide` is
  the real twin, run in tests/e2e), the critic's and reward model's stages included (their twin:
  tests/e2e/test_ppo_job.py): each stage sleeps a chosen time and records the event; the
  "weights" are one tensor holding the number of optimizer steps taken; `log` keeps each step's
  merged metrics.
- `CharTokenizer` and `make_generate_side`: a real `GenerateSide` with a real dataset (the
  arithmetic task written locally), the real reward and validator, over a `TimedEngine`.
- `run_generate`: the engine host's side (`jobs/generate_pipeline.py:GeneratePipeline`) built
  and run in the calling thread, a side thread's target beside `run_learn_pipeline`.
- `ScriptedReward`: a reward whose values the test chooses by (prompt uid, sample index): the
  `FakeEngine` answers a prompt the same way for every sample, so no reward of the response
  could make a group informative (refill tests). Its twin, a reward of the real engine's
  sampled responses, runs in tests/e2e/test_refill_job.py.
- `SyncCheckpoints` and `LedgerLearner`: a checkpoint manager that meets both sides at every
  step boundary and keeps what each saved, and a `FakeLearner` that keeps each trained step's
  prompt uids and token versions (`test_async_checkpoint.py`, `test_refill_pipeline.py`).
- `run_async` and `stable`: both sides of the asynchronous loop in one process, and metrics
  without their timing-dependent keys (`test_async_pipeline.py`, `test_refill_pipeline.py`).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from megatron_async_rl.algorithms.config import GRPOConfig
from megatron_async_rl.checkpoint.config import Preempted
from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import GenerateResult
from megatron_async_rl.jobs.exchange import LocalExchange
from megatron_async_rl.jobs.generate_pipeline import GeneratePipeline
from megatron_async_rl.jobs.grpo_async import run_learn_pipeline
from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.recipe.schema import TrainerConfig
from megatron_async_rl.rewards.registry import SafeReward, get_reward
from megatron_async_rl.roles.generate import GenerateSide
from megatron_async_rl.roles.work import StepReport, StepWork
from megatron_async_rl.rollout.dataset import DatasetConfig, PromptDataset
from megatron_async_rl.rollout.generation import RolloutConfig
from megatron_async_rl.rollout.refill import informative_groups
from megatron_async_rl.rollout.validation import ValidationConfig, Validator
from megatron_async_rl.scheduler.config import SchedulerConfig
from megatron_async_rl.tasks.arithmetic import write_arithmetic_dataset


def run_generate(*args) -> None:
    """`GeneratePipeline(*args).run()`: built in the thread that runs it, as on a rank."""
    GeneratePipeline(*args).run()


class CharTokenizer:
    """Characters as token ids; no special tokens."""

    eos_token_id = None
    pad_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 96 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i % 10) for i in ids)


class TimedEngine(FakeEngine):
    """A FakeEngine that generates one position every `token_s` seconds (all requests of a
    call together) and honours pause/resume and weight updates between positions; it refuses a
    cache flush while requests are held in place, as SGLang does."""

    def __init__(self, token_s: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.token_s = token_s
        self._cond = threading.Condition()
        self._running = 0
        self._aborted = 0  # +1 per abort of everything in flight (generations compare)

    def generate(self, requests):
        self._enter("generate", rids=[r.rid for r in requests])
        self.sessions.check_whole()
        with self._cond:
            self._running += 1
            aborted = self._aborted
        try:
            outputs = [([], []) for _ in requests]
            cut = False
            for position in range(max(r.sampling.max_new_tokens for r in requests)):
                time.sleep(self.token_s)
                with self._cond:
                    self._cond.wait_for(lambda: self.paused is None)
                    version = self._version
                    cut = self._aborted != aborted
                if cut:
                    break
                for request, (ids, versions) in zip(requests, outputs):
                    if position < request.sampling.max_new_tokens:
                        ids.append(self.token(request.input_ids, position, version))
                        versions.append(version)
            return [
                GenerateResult(r.rid, ids, [self.logprob(t) for t in ids], versions,
                               "abort" if len(ids) < r.sampling.max_new_tokens else "length")
                for r, (ids, versions) in zip(requests, outputs)
            ]  # fmt: skip
        finally:
            with self._cond:
                self._running -= 1

    def abort(self, rid=None):
        """Every request in flight comes back with what it has (as SGLang's abort-all)."""
        assert rid is None, "TimedEngine aborts everything in flight only"
        with self._cond:
            super().abort(rid)
            self._aborted += 1
            self._cond.notify_all()

    def pause(self, mode):
        with self._cond:
            super().pause(mode)

    def resume(self):
        with self._cond:
            super().resume()
            self._cond.notify_all()

    def update_weights(self, named_tensors, version, flush_cache=True):
        with self._cond:  # SGLang's rules for requests held by a pause
            if self._running and self.paused is None:
                raise RuntimeError("update_weights while generating without a pause")
            if self._running and self.paused == "in_place" and flush_cache:
                raise RuntimeError("SGLang refused flush_cache (requests held in place)")
            super().update_weights(named_tensors, version, flush_cache)

    def flush_cache(self):
        with self._cond:
            if self._running or self.paused is not None or self._in_update:
                raise RuntimeError("SGLang refused flush_cache (requests in flight?)")
            super().flush_cache()


class FakeLearner:
    """The learn side's methods without a model; `durations(stage, step)` gives sleep times."""

    def __init__(self, durations=lambda stage, step: 0.0):
        self.durations = durations
        self.logp_version = 0
        self.critic_version = 0
        self.trained = 0
        self.events: list[tuple[str, int]] = []
        self.logged: list[dict] = []
        self._lock = threading.Lock()

    def _stage(self, name: str, work: StepWork) -> StepWork:
        time.sleep(self.durations(name, work.step))
        with self._lock:
            self.events.append((name, work.step))
        return work

    def logp_waits_for(self, work):
        if self.logp_version < work.step:
            return f"logp weights v{work.step} (logp holds v{self.logp_version})"
        return None

    def weights_synced(self, version):
        self.logp_version = version

    def critic_waits_for(self, work):
        if self.critic_version < work.step:
            return f"the critic trained through step {work.step - 1}"
        return None

    def logp(self, work):
        return self._stage("logp", work)

    def ref(self, work):
        return self._stage("ref", work)

    def reward_model(self, work):
        return self._stage("reward_model", work)

    def critic_values(self, work):
        work.batch_metrics["critic/values_from"] = float(self.critic_version)
        return self._stage("critic_values", work)

    def critic_train(self, work):
        self._stage("critic_train", work)
        self.critic_version = work.step + 1
        work.report.add_sums({"critic/value_loss": 0.25})
        return work

    def train(self, work):
        self._stage("train", work)
        self.trained += 1
        rewards = [s.reward for s in work.samples]
        work.batch_metrics["reward/mean"] = sum(rewards) / len(rewards)
        work.batch_metrics["samples/num"] = float(len(work.samples))
        sizes = {}
        for sample in work.samples:
            sizes[sample.prompt_index] = sizes.get(sample.prompt_index, 0) + 1
        flags = informative_groups(work.samples, max(sizes.values()))
        work.batch_metrics["batch/groups"] = float(len(flags))
        work.batch_metrics["batch/informative_groups"] = float(sum(flags.values()))
        work.batch_metrics["batch/prompt_indices"] = sorted(sizes)
        work.batch_metrics["batch/uids"] = [s.uid for s in work.samples]
        work.report.add_sums({"actor/loss": 0.5})
        return work

    def log(self, work, step_s):
        metrics = StepReport.merge([work.report, *work.gen_reports])
        metrics.update(work.batch_metrics)
        metrics["step"] = work.step
        self.logged.append(metrics)

    def state(self) -> dict[str, torch.Tensor]:
        return {"model.weight": torch.tensor([float(self.trained)])}


class ScriptedReward(SafeReward):
    """Reward `sample_index % 2` for the samples of an informative prompt (`informative(uid)`),
    0.0 for the others; counted as the real reward counts its calls."""

    def __init__(self, informative):
        super().__init__(lambda *_: 0.0, "scripted")
        self.informative = informative

    def score(self, samples, fault=None):
        samples = list(samples)
        self.calls += len(samples)
        return [float(s.sample_index % 2) if self.informative(s.uid) else 0.0 for s in samples]


def every_third(uid: str) -> bool:
    """Rows 3, 6, 9, ... of a dataset file are informative (`uid` is `file:line`)."""
    return int(uid.rsplit(":", 1)[1]) % 3 == 0


def make_cfg(tmp_path, *, steps: int, ahead: int, mode: str = "wait", validation_every=0,
             validation_version="exact", timeout_s: float = 30.0, prompts: int = 2,
             samples: int = 2, max_new_tokens: int = 4, pause: str = "retract",
             refill: bool = False, max_refill_rounds: int = 10,
             refill_exhausted: str = "pad",
             roles=("train", "logp", "ref", "generate")):  # fmt: skip
    data = write_arithmetic_dataset(tmp_path / "train.jsonl", num_rows=40, seed=0)
    val = write_arithmetic_dataset(tmp_path / "val.jsonl", num_rows=4, seed=1)
    return SimpleNamespace(
        seed=7,
        data=DatasetConfig(path=str(data)),
        rollout=RolloutConfig(num_prompts_per_step=prompts, max_new_tokens=max_new_tokens),
        algorithm=GRPOConfig(
            num_samples_per_prompt=samples,
            dynamic_filtering=refill,
            refill=refill,
            max_refill_rounds=max_refill_rounds,
            refill_exhausted=refill_exhausted,
        ),
        trainer=TrainerConfig(job="grpo", num_steps=steps),
        scheduler=SchedulerConfig(
            generate_ahead_steps=ahead,
            weight_update_mode=mode,
            in_flight_pause=pause,
            stage_timeout_s=timeout_s,
            validation_every=validation_every,
            validation_version=validation_version,
            loop="async" if ahead == 0 else "auto",
        ),  # fmt: skip
        validation=ValidationConfig(data=DatasetConfig(path=str(val)), num_prompts=2),
        roles=SimpleNamespace(placed_roles=lambda: tuple(roles)),
    )


def make_generate_side(cfg, engine, reward=None, engine_index=0, num_engines=1,
                       rounds=None) -> GenerateSide:  # fmt: skip
    tokenizer = CharTokenizer()
    dataset = PromptDataset(cfg.data, tokenizer=tokenizer)
    reward = reward or SafeReward(get_reward("arithmetic"), "arithmetic")
    validator = None
    if cfg.scheduler.validation_every:
        held_out = PromptDataset(cfg.validation.data, tokenizer=tokenizer)
        validator = Validator(
            cfg.validation, cfg.rollout, held_out.records[:2],
            SafeReward(get_reward("arithmetic"), "arithmetic"), 0, 1, cfg.seed,
        )  # fmt: skip
    return GenerateSide(cfg, engine, tokenizer, dataset, reward, validator, engine_index,
                        num_engines, rounds=rounds)  # fmt: skip


class SyncCheckpoints:
    """Meets the learner and the engine host at every boundary (a barrier each), saves when
    `due`, and at `stop_at` saves and stops both; keeps what each side saved."""

    def __init__(self, steps: int, due=(), stop_at: int | None = None, learner_late_s=0.0):
        self.steps, self.due_at, self.stop_at = steps, set(due), stop_at
        self.learner_late_s = learner_late_s
        """Seconds the learner takes to reach each boundary after its version exists (logging,
        say): the engine host loads the version and starts generating meanwhile."""
        self.barrier = threading.Barrier(2, timeout=60)
        self.saved: dict[int, dict] = {}

    def boundary(self, version):
        if threading.current_thread().name != "checkpoint-boundaries":  # the learner
            time.sleep(self.learner_late_s)
        self.barrier.wait()
        stop = version == self.stop_at
        return stop or version in self.due_at or version == self.steps, stop

    def save(self, version, gen, learn, pending=None, extra=None, wait=False):
        self.barrier.wait()
        entry = self.saved.setdefault(version, {})
        if gen is not None:
            entry["gen"] = {"pending": pending.state_dict(), **extra,
                            "cursor": gen.dataset.state_dict()}  # fmt: skip
        if learn is not None:
            entry["learn"] = {"trained": learn.trained}
        self.barrier.wait()
        return {}

    def export_due(self, version):
        return False

    def take_metrics(self):
        return {}

    def stop_error(self, version):  # `CheckpointManager.stop_error` on a save-and-exit signal
        return Preempted(f"a save-and-exit signal at version {version}")


class LedgerLearner(FakeLearner):
    """Keeps each trained step's prompt uids and token versions."""

    def __init__(self, trained: int = 0, durations=lambda stage, step: 0.0):
        super().__init__(durations)
        self.trained = self.logp_version = trained
        self.pending_metrics: dict = {}
        self.ledger: dict[int, tuple[list[str], list[int]]] = {}

    def train(self, work):
        uids = sorted({s.prompt_index: s.uid for s in work.samples}.items())
        versions = [v for per in work.token_versions() for v in per]
        self.ledger[work.step] = ([u for _, u in uids], versions)
        return super().train(work)


VOLATILE = ("timing/", "scheduler/", "utilization/", "weight_sync/stall_s")


def run_async(cfg, engine, learner, clocks=None, errors=None, gen=None):
    """Both sides of the asynchronous loop in one process: (generate clock, learn clock).
    With `errors` (a dict), each side's error is kept there by side instead of raised. `gen`:
    the generate side (default: `make_generate_side(cfg, engine)`)."""
    gen = gen or make_generate_side(cfg, engine)
    # A transfer waits for a whole step of the other side: its timeout is the transport's (gloo's
    # on ranks), longer than any one stage's.
    exchange = LocalExchange(learner.state, timeout_s=3 * cfg.scheduler.stage_timeout_s)
    gen_clock, learn_clock = clocks or (RankClock(1, ("generate",)), RankClock(0, ("train",)))
    raised = {} if errors is None else errors

    def side(name, fn, *args):
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001 - re-raised by the test
            raised[name] = err

    threads = [
        threading.Thread(
            target=side, args=("generate", run_generate, gen, exchange, gen_clock, cfg, 1)
        ),
        threading.Thread(
            target=side,
            args=("learn", run_learn_pipeline, learner, exchange, learn_clock, cfg, 0, "train"),
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a side never finished"
    if raised and errors is None:
        raise next(iter(raised.values()))
    return gen_clock, learn_clock


def stable(metrics: dict) -> dict:
    """`metrics` without the timing-dependent keys (`VOLATILE`)."""
    return {k: v for k, v in metrics.items() if not k.startswith(VOLATILE)}
