"""The generate stage's multi-turn path (`rollout/agentic.py`, `roles/generate.py`), in process.

Contracts, on `FakeEngine` with the tiny tokenizer's chat template:
- a recipe's `environment:` (a `module:Class` plug-in here) makes every sample a whole
  trajectory: `response_ids` are all tokens after the prompt; `loss_mask` is 1 exactly on the
  engine's tokens, which keep the engine's log-probs and version labels ('' and 0.0 elsewhere);
  `response_text` is the final answer; the GRPO group of a prompt is its n trajectories;
- the reward is the environment's rewards plus `reward_fn_weight` x the reward function on the
  final answer, 0 for a failed environment;
- the training batch masks the environment's tokens, and the staleness check sees the trained
  tokens' versions only;
- a turn the engine cuts short is continued from its partial output (its tokens kept); a cut
  stage drops the step's trajectories (`partial`, regenerated), never trains them.
The real engine's twin: `tests/e2e/test_multiturn_job.py` (and, for `multiturn` alone,
`tests/distributed/test_sglang_engine.py::test_multiturn_on_the_real_engine`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_async_rl.algorithms.grpo import GRPOConfig
from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import GenerateResult, SamplingParams
from megatron_async_rl.models.tiny import build_tokenizer
from megatron_async_rl.rewards.registry import SafeReward, get_reward
from megatron_async_rl.roles.generate import GenerateSide
from megatron_async_rl.rollout.agentic import MultiTurnRollout, ratio_metrics
from megatron_async_rl.rollout.batch import build_batch
from megatron_async_rl.rollout.config import DatasetConfig, EnvironmentConfig, RolloutConfig
from megatron_async_rl.rollout.dataset import PromptDataset
from megatron_async_rl.rollout.environment import EpisodeSample, StepResult
from megatron_async_rl.rollout.multiturn import Cut, MultiTurnLimits, generate_trajectories
from megatron_async_rl.scheduler.config import SchedulerConfig
from megatron_async_rl.scheduler.staleness import StalenessController
from megatron_async_rl.tasks.arithmetic import write_arithmetic_dataset


class EchoTwice:
    """Answers the first action with a user message and a reward of 0.25, ends on the second
    (reward 0.5); `broken=True` raises on the second step."""

    def __init__(self, broken: bool = False):
        self.turn, self.broken = 0, broken

    def reset(self, sample):
        return None

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult("try again", 0.25, False)
        if self.broken:
            raise RuntimeError("the environment broke")
        return StepResult(None, 0.5, True)


def _side(tmp_path, engine, **env) -> GenerateSide:
    data = write_arithmetic_dataset(tmp_path / "train.jsonl", num_rows=20, seed=0)
    cfg = SimpleNamespace(
        seed=3,
        data=DatasetConfig(path=str(data)),
        rollout=RolloutConfig(num_prompts_per_step=2, max_new_tokens=4, use_chat_template=True),
        algorithm=GRPOConfig(num_samples_per_prompt=3),
        scheduler=SchedulerConfig(generate_ahead_steps=1),
        environment=EnvironmentConfig(name=f"{__name__}:EchoTwice", **env),
    )
    tokenizer = build_tokenizer()
    dataset = PromptDataset(cfg.data, tokenizer=tokenizer, use_chat_template=True)
    reward = SafeReward(get_reward("arithmetic"), "arithmetic")
    return GenerateSide(cfg, engine, tokenizer, dataset, reward, None, 0, 1,
                        MultiTurnRollout(cfg.environment))  # fmt: skip


def test_trajectories_become_masked_samples_with_mixed_rewards(tmp_path):
    engine = FakeEngine(vocab_size=96)
    side = _side(tmp_path, engine, reward_fn_weight=2.0)
    work = side.score(side.generate(side.load(step=1)))
    assert len(work.samples) == 6 and not work.partial
    groups = {}
    for sample in work.samples:
        groups.setdefault(sample.prompt_index, []).append(sample.sample_index)
        mask, versions = sample.loss_mask, sample.token_versions
        assert len(mask) == len(sample.response_ids) == len(sample.response_logprobs)
        assert 0 in mask and 1 in mask and sample.metadata["turns"] == 2
        for m, token, logprob, version in zip(mask, sample.response_ids,
                                              sample.response_logprobs, versions):  # fmt: skip
            if m:  # the engine's token, as it sampled it
                assert logprob == FakeEngine.logprob(token) and version == "default"
            else:
                assert logprob == 0.0 and version == ""
        # the arithmetic reward scores the final answer (never right here): 0.25 + 0.5 + 2 x 0
        assert sample.reward == pytest.approx(0.75)
        assert sample.response_text == side.tokenizer.decode(
            sample.response_ids[len(mask) - mask[::-1].index(0):], skip_special_tokens=True)
    assert groups == {0: [0, 1, 2], 1: [0, 1, 2]}  # GRPO groups of whole trajectories
    sums = work.report.state_dict()["sums"]
    assert sums["multiturn/trajectories"] == 6 and sums["multiturn/turns"] == 12
    means = ratio_metrics(sums)
    assert means["multiturn/turns_mean"] == 2.0 and 0 < means["multiturn/masked_token_frac"] < 1

    batch = build_batch(work.samples, pad_id=0)
    first = work.samples[0]
    p, r = len(first.prompt_ids), len(first.response_ids)
    assert batch["mask"][0, p - 1 : p - 1 + r].tolist() == [float(m) for m in first.loss_mask]
    assert batch["mask"][0].sum().item() == sum(first.loss_mask)
    # the staleness check reads the trained tokens only (environment tokens have no version)
    assert all(len(v) == sum(s.loss_mask) for v, s in zip(work.token_versions(), work.samples))
    StalenessController(1).check_batch(1, work.token_versions())


def test_environment_steps_are_timeline_spans(tmp_path):
    from megatron_async_rl.observability.trace import TraceRecorder

    side = _side(tmp_path, FakeEngine(vocab_size=96))
    side.trace = TraceRecorder(0, ("generate",))
    side.generate(side.load(step=4))
    spans = [s for s in side.trace.spans() if s["stage"] == "environment"]
    assert len(spans) == 2  # one per turn: the environments of a turn step together


def test_failed_environment_scores_zero(tmp_path):
    side = _side(tmp_path, FakeEngine(vocab_size=96), kwargs={"broken": True})
    work = side.score(side.generate(side.load(step=1)))
    assert all(s.reward == 0.0 and s.metadata["finish"] == "env_error" for s in work.samples)
    assert work.report.state_dict()["sums"]["multiturn/env_errors"] == 6


class AbortOnce(FakeEngine):
    """Cuts every request of its first `generate` short after 2 tokens (an in-place pause)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls_made, self.requests = 0, []

    def generate(self, requests):
        self.calls_made += 1
        self.requests.append(list(requests))
        results = super().generate(requests)
        if self.calls_made > 1:
            return results
        return [GenerateResult(r.rid, r.output_ids[:2], r.output_logprobs[:2],
                               r.token_versions[:2], "abort") for r in results]  # fmt: skip


def _one_turn(engine, should_stop=None):
    tok = build_tokenizer()
    ids = [tok.encode("<|user|>1+1=<eos><|assistant|>", add_special_tokens=False)]
    return generate_trajectories(
        engine, tok, lambda: EchoTwice(), [EpisodeSample("1+1=")], ids,
        SamplingParams(max_new_tokens=5, temperature=1.0), MultiTurnLimits(max_turns=1),
        should_stop=should_stop,
    )  # fmt: skip


def test_a_turn_cut_short_is_continued_and_a_cut_stage_drops_it():
    engine = AbortOnce(vocab_size=96)
    trajectories, _, counts = _one_turn(engine)
    reference, _, _ = _one_turn(FakeEngine(vocab_size=96))
    assert counts["continued"] == 1
    first, again = engine.requests[0][0], engine.requests[1][0]
    kept = reference[0].ids[:2]  # what the cut turn had sampled (FakeEngine is deterministic)
    assert trajectories[0].ids[:2] == kept
    assert again.input_ids == first.input_ids + kept  # continued from its partial output
    assert again.sampling.max_new_tokens == 3  # the turn's budget less what it had
    assert trajectories[0].loss_mask[:5] == [1] * 5
    with pytest.raises(Cut):
        _one_turn(AbortOnce(vocab_size=96), should_stop=lambda: True)


def test_a_cut_generate_stage_drops_the_steps_trajectories(tmp_path):
    side = _side(tmp_path, AbortOnce(vocab_size=96))
    original = side.multi_turn.samples

    def cut_during(*args, **kwargs):
        with side._cut_lock:
            side._cut = True
        return original(*args, **kwargs)

    side.multi_turn.samples = cut_during
    work = side.generate(side.load(step=1))
    assert work.partial and work.samples == []
    assert work.report.state_dict()["sums"]["multiturn/trajectories_dropped_by_cut"] == 1


def test_environment_section_rules(tmp_path):
    from megatron_async_rl.config.errors import ConfigError
    from megatron_async_rl.recipe.load import build_config

    data = write_arithmetic_dataset(tmp_path / "train.jsonl", num_rows=4, seed=0)
    tree = {"run_dir": str(tmp_path / "run"), "model": {"hf_path": None},
            "roles": {"groups": [{"roles": ["train", "logp", "ref"], "num_ranks": 1},
                                 {"roles": ["generate"], "num_ranks": 1}]},
            "data": {"path": str(data)}, "environment": {"name": "tools"},
            "trainer": {"job": "role_check"}, "megatron": {"vocab_size": 96}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"environment.tools = \[\]: the tools environment "
                       "needs at least one tool"):  # fmt: skip
        build_config(tree, [])
    tree["environment"] = {"name": f"{__name__}:EchoTwice"}
    tree["scheduler"] = {"validation_every": 2}
    tree["validation"] = {"data": {"path": str(data)}}
    with pytest.raises(ConfigError, match="scheduler.validation_every = 2: validation passes "
                       "are single-turn"):  # fmt: skip
        build_config(tree, [])
    with pytest.raises(Exception, match="are called by the 'tools' environment"):
        EnvironmentConfig(name="pkg:Env", tools=["pkg:f"])
    with pytest.raises(Exception, match="max_turns"):
        EnvironmentConfig(name="pkg:Env", max_turns=0)
    assert not EnvironmentConfig().multi_turn
