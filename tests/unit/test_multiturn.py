"""Multi-turn rollouts on an engine, turn by turn (`rollout/multiturn.py`), on `FakeEngine`.

Contracts: each turn continues from the trajectory's own token ids (prompt, the model's
sampled tokens, the environment's template tokens), never from re-tokenised text; model tokens
keep the engine's log-probs and versions (a weight update between turns shows in them);
environment tokens are masked; a trajectory ends on done, max_turns or its token budget;
an environment that raises ends only its trajectory (counted). The real engine's twin:
`tests/distributed/test_sglang_engine.py::test_multiturn_on_the_real_engine`.
"""

from __future__ import annotations

from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import SamplingParams
from megatron_async_rl.models.tiny import build_tokenizer
from megatron_async_rl.rollout.environment import EpisodeSample, StepResult
from megatron_async_rl.rollout.multiturn import MultiTurnLimits, generate_trajectories
from megatron_async_rl.rollout.turns import observation_ids
from tests.harness.environments import ToolTurns


class Recording(FakeEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests = []

    def generate(self, requests):
        self.requests.append(list(requests))
        return super().generate(requests)


def _run(engine, limits, make_env=ToolTurns, prompts=("a", "b")):
    tok = build_tokenizer()
    samples = [EpisodeSample(prompt=p) for p in prompts]
    prompt_ids = [tok.encode(f"<|user|>{p}<eos><|assistant|>", add_special_tokens=False)
                  for p in prompts]  # fmt: skip
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0)
    return tok, prompt_ids, generate_trajectories(engine, tok, make_env, samples, prompt_ids,
                                                  sampling, limits)  # fmt: skip


def test_turns_continue_from_the_trajectory_tokens():
    engine = Recording(vocab_size=96)
    tok, prompt_ids, (trajs, episodes, counts) = _run(engine, MultiTurnLimits(max_turns=4))
    assert [e.finish_reason for e in episodes] == ["done", "done"]
    assert [e.reward for e in episodes] == [1.0, 1.0] and counts["turns"] == 6
    requests = [r for call in engine.requests for r in call]
    assert len(requests) == 6  # each trajectory's turns go to the engine on their own
    for request in requests:
        _, index, turn = request.rid.split("-")
        index, turn = int(index), int(turn[1:])
        seen = len(request.input_ids) - len(prompt_ids[index])
        assert request.input_ids == trajs[index].context()[: len(request.input_ids)]
        if turn:  # after a model turn and the tool's template tokens
            assert trajs[index].loss_mask[seen - 1] == 0
    traj = trajs[0]
    first = traj.loss_mask.index(0)
    tool = observation_ids(tok, [{"role": "tool", "content": "result 1"}])
    assert traj.ids[first + 1 : first + 1 + len(tool)] == tool  # after <eos> closing the turn
    for mask, version, logprob in zip(traj.loss_mask, traj.versions, traj.logprobs, strict=True):
        assert (version >= 0 and logprob < 0) if mask else (version == -1 and logprob == 0.0)


def test_budget_and_failures_end_only_their_trajectory():
    engine = Recording(vocab_size=96)
    _, _, (trajs, episodes, counts) = _run(engine, MultiTurnLimits(max_total_tokens=12))
    assert {e.finish_reason for e in episodes} == {"budget"} and counts["budget"] == 2
    assert all(len(t.ids) <= 12 for t in trajs)  # an observation that does not fit ends it
    _, _, (_, episodes, counts) = _run(Recording(vocab_size=96), MultiTurnLimits(),
                                       make_env=lambda: ToolTurns(fail_on="b"))  # fmt: skip
    assert [e.finish_reason for e in episodes] == ["done", "env_error"]
    assert episodes[1].reward == 0.0 and counts["env_errors"] == 1


def test_a_trajectory_never_outgrows_the_engines_context():
    """Turns ask for no more tokens than the engine's context leaves and send no longer input
    than it takes (SGLang refuses either, and that would end the step); a trajectory with no
    room left ends. The limits are the real engine's (`SGLangEngine.context_tokens`,
    `max_input_tokens`: tests/distributed/test_sglang_engine.py)."""
    engine = Recording(vocab_size=96)
    tok, prompt_ids, (trajs, episodes, counts) = _run(
        engine, MultiTurnLimits(max_turns=4, max_context_tokens=24, max_input_tokens=20))
    for call in engine.requests:
        for request in call:
            assert len(request.input_ids) + request.sampling.max_new_tokens <= 24
            assert len(request.input_ids) < 20
    assert {e.finish_reason for e in episodes} == {"budget"} and counts["budget"] == 2


class HugeAnswer(ToolTurns):
    """Answers with 5000 characters of tool output."""

    def step(self, action):
        return StepResult([{"role": "tool", "content": "9" * 5000}], 0.0, False)


def test_an_observation_that_does_not_fit_ends_the_trajectory_unappended():
    """A tool answering with thousands of tokens would make one sample longer than the batch
    can hold (the trainer ran out of 24 GiB on one, in a real run): it is not appended, the
    trajectory ends as budget, counted."""
    _, _, (trajs, episodes, counts) = _run(Recording(vocab_size=96),
                                           MultiTurnLimits(max_total_tokens=200),
                                           make_env=HugeAnswer)  # fmt: skip
    assert {e.finish_reason for e in episodes} == {"budget"}
    assert counts["observation_too_long"] == 2
    assert all(len(t.ids) <= 200 and 0 not in t.loss_mask for t in trajs)
