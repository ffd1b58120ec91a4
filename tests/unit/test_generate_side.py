"""`roles.generate.GenerateSide.generate`: responses cut short are continued, never trained cut.

Contract checked (a real `GenerateSide` with its dataset and reward; faked: the engine, a
`FakeEngine` that returns the first responses of a call cut short as SGLang's abort does):
- a response that comes back aborted while nothing asked for it is continued from its prefix
  (prompt + prefix as input, the budget left), so the step's samples are whole; an engine that
  aborts three calls in a row stops the run with an error naming the step;
- `cut()` during a generation returns the work partial, its samples the prefixes, and the same
  work given back continues from them to whole responses (prefix tokens counted); a prefix
  older than the step's window is generated again (counted);
- `cut()` with no generation running does nothing.
"""

from __future__ import annotations

import pytest

from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import GenerateResult
from tests.unit.pipeline_fakes import make_cfg, make_generate_side


class CuttingEngine(FakeEngine):
    """Returns the first `cut_calls` generate calls cut after `keep` tokens ("abort");
    `on_generate` runs inside each call (e.g. the generate side's `cut`)."""

    def __init__(self, cut_calls: int, keep: int = 2):
        super().__init__()
        self.cut_calls, self.keep, self.on_generate = cut_calls, keep, None
        self.asked: list[list] = []

    def generate(self, requests):
        self.asked.append(list(requests))
        if self.on_generate is not None:
            self.on_generate()
        results = super().generate(requests)
        if len(self.asked) > self.cut_calls:
            return results
        return [GenerateResult(r.rid, r.output_ids[: self.keep], r.output_logprobs[: self.keep],
                               r.token_versions[: self.keep], "abort")
                for r in results]  # fmt: skip


def _side(tmp_path, engine, ahead=1):
    cfg = make_cfg(tmp_path, steps=4, ahead=ahead, prompts=2, samples=2, max_new_tokens=5)
    return make_generate_side(cfg, engine)


def test_a_response_aborted_by_nobody_is_continued_to_the_whole(tmp_path):
    engine = CuttingEngine(cut_calls=1)
    side = _side(tmp_path, engine)
    work = side.generate(side.load(0))
    assert not work.partial and len(engine.asked) == 2
    assert all(len(s.response_ids) == 5 and s.finish_reason == "length" for s in work.samples)
    first, again = engine.asked
    assert again[0].input_ids == first[0].input_ids + work.samples[0].response_ids[:2]
    assert again[0].sampling.max_new_tokens == 3


def test_an_engine_that_keeps_aborting_stops_the_run_naming_the_step(tmp_path):
    side = _side(tmp_path, CuttingEngine(cut_calls=10, keep=0))  # no progress at all
    with pytest.raises(RuntimeError, match="step 0: the engine aborted 4 response"):
        side.generate(side.load(0))


def test_a_cut_generation_returns_partial_and_goes_on_from_its_prefixes(tmp_path):
    engine = CuttingEngine(cut_calls=1)
    side = _side(tmp_path, engine)
    engine.on_generate = lambda: side.cut()
    work = side.generate(side.load(1))
    assert work.partial and all(len(s.response_ids) == 2 for s in work.samples)
    assert [c[0] for c in engine.calls if c[0] == "abort"] == ["abort"]
    engine.on_generate = None
    work = side.generate(work)
    assert not work.partial and all(len(s.response_ids) == 5 for s in work.samples)
    assert engine.asked[1][0].input_ids[-2:] == work.samples[0].response_ids[:2]
    assert work.report.sums["rollout/prefix_tokens_kept"] == 4 * 2
    assert work.report.sums["rollout/prefix_tokens_regenerated"] == 0


def test_a_prefix_older_than_the_window_is_generated_again(tmp_path):
    engine = CuttingEngine(cut_calls=1)
    side = _side(tmp_path, engine, ahead=0)
    engine.on_generate = lambda: side.cut()
    work = side.generate(side.load(0))  # prefixes from the engine's initial weights: version 0
    engine.on_generate = None
    work.step = 1  # resumed one version later, with N = 0: version 0 is out of the window
    work = side.generate(work)
    assert engine.asked[1][0].sampling.max_new_tokens == 5  # from the prompt
    assert work.report.sums["rollout/prefix_tokens_regenerated"] == 4 * 2
    assert work.report.sums["rollout/prefix_tokens_kept"] == 0


def test_cut_with_nothing_generating_does_nothing(tmp_path):
    engine = CuttingEngine(cut_calls=0)
    side = _side(tmp_path, engine)
    assert side.cut() is False and "abort" not in engine.methods_called()


def test_a_response_aborted_as_it_filled_its_budget_is_whole(tmp_path):
    engine = CuttingEngine(cut_calls=1, keep=5)  # "abort", but all 5 tokens are out
    side = _side(tmp_path, engine)
    work = side.generate(side.load(0))
    assert not work.partial and len(engine.asked) == 1
    assert all(s.finish_reason == "length" for s in work.samples)
