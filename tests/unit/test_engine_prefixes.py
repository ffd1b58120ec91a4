"""`engines.recovery.prefixes` and `engines.recovery.progress`: requests cut short go on from
their prefix.

Contract checked, against hand-made results (nothing faked: the modules are pure): a prefix is
kept whole when its first token is inside the step's window and thrown away (counted) when it
is older; the continuation asks for the prompt plus the prefix with the budget reduced by it,
under the same id and seed, and nothing for a finished response; the join keeps every token's
log-prob and version; SGLang's streamed outputs (plain dicts, lists still growing) become
reports cut to the tokens every field covers; the rank side forgets a call's reports once it
returned and hands a failed call's reports out once.
"""

from __future__ import annotations

import pytest

from megatron_async_rl.engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from megatron_async_rl.engines.recovery import prefixes
from megatron_async_rl.engines.recovery.progress import PartialResults, ProgressReporter, snapshot


def _request(max_new_tokens=6):
    return GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens, seed=7), "r")


def _result(ids, versions, reason="abort"):
    return GenerateResult("r", list(ids), [-0.5 - i for i in ids], list(versions), reason)


def test_a_prefix_inside_the_window_is_kept_and_one_older_thrown_away():
    partial = _result([5, 6], ["3", "4"])
    assert prefixes.kept_prefix(partial, oldest_version=3) == (partial, 0)
    assert prefixes.kept_prefix(partial, oldest_version=4) == (None, 2)
    assert prefixes.kept_prefix(partial, oldest_version=None) == (partial, 0)
    assert prefixes.kept_prefix(None, 3) == (None, 0)
    assert prefixes.kept_prefix(_result([], []), 3) == (None, 0)
    # the engine's initial label is version 0
    assert prefixes.kept_prefix(_result([5], ["default"]), 1) == (None, 1)


def test_the_continuation_asks_for_the_rest_with_the_prefix_as_input():
    request = _request()
    more = prefixes.continuation(request, _result([5, 6], ["1", "1"]))
    assert more.input_ids == [1, 2, 3, 5, 6] and more.rid == "r"
    assert more.sampling.max_new_tokens == 4 and more.sampling.seed == 7
    assert prefixes.continuation(request, None) is request
    assert prefixes.continuation(request, _result([5, 6], ["1", "1"], "stop")) is None
    with pytest.raises(AssertionError, match="fills max_new_tokens"):
        prefixes.continuation(_request(2), _result([5, 6], ["1", "1"]))


def test_the_join_keeps_each_token_s_log_prob_and_version():
    kept, rest = _result([5, 6], ["1", "1"]), _result([7, 8], ["2", "2"], "stop")
    whole = prefixes.joined(kept, rest)
    assert whole.output_ids == [5, 6, 7, 8]
    assert whole.output_logprobs == kept.output_logprobs + rest.output_logprobs
    assert whole.token_versions == ["1", "1", "2", "2"] and whole.finish_reason == "stop"
    assert prefixes.joined(None, rest) is rest and prefixes.joined(kept, None) is kept


def _streamed(ids, logprobs, spans, finish=None):
    meta = {"output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, ids)],
            "weight_versions": spans, "finish_reason": finish}  # fmt: skip
    return {"output_ids": ids, "meta_info": meta, "index": 0}


def test_a_streamed_output_becomes_a_report_cut_to_what_every_field_covers():
    spans = [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}]
    out = _streamed([5, 6, 7, 8], [-1.0, -2.0, -3.0], spans)  # ids grew past the rest
    assert snapshot(out) == ([5, 6, 7], [-1.0, -2.0, -3.0], ["1", "1", "2"], None)
    done = _streamed([5, 6], [-1.0, -2.0], spans[:1], {"type": "stop"})
    assert snapshot(done) == ([5, 6], [-1.0, -2.0], ["1", "1"], "stop")
    cut = _streamed([5, 6, 7], [-1.0, -2.0], spans[:1], {"type": "stop"})
    assert snapshot(cut)[3] is None  # not whole yet: a prefix


def test_reports_travel_from_host_to_rank_and_are_handed_out_once():
    sent = []
    reporter = ProgressReporter(sent.append)
    spans = [{"version": "1", "start": 0, "end": 1}]
    reporter.record("a", _streamed([5], [-1.0], spans))
    reporter.record("b", _streamed([6], [-2.0], spans, {"type": "length"}))
    reporter.flush()
    reporter.flush()  # nothing changed: nothing sent
    assert [m[0] for m in sent] == ["progress"]
    reporter.forget(["a"])
    reporter.record("a", _streamed([5], [-1.0], spans))
    reporter.forget(["a"])
    reporter.flush()
    assert len(sent) == 1
    rank = PartialResults()
    rank.update(sent[0][1])
    got = rank.take(["a", "b", "c"])
    assert got["a"] == GenerateResult("a", [5], [-1.0], ["1"], "abort")
    assert got["b"].finish_reason == "length" and set(got) == {"a", "b"}
    assert rank.take(["a"]) == {}
    rank.update(sent[0][1])
    rank.forget(["a", "b"])
    assert rank.take(["a", "b"]) == {}


def test_a_prefix_cut_as_its_last_token_came_out_is_a_whole_response():
    """SGLang's abort can overtake the finish of a request whose last token is out (found by
    the checkpoint soak): such a prefix is settled as finished and never continued."""
    request = GenerateRequest([1], SamplingParams(max_new_tokens=2, stop_token_ids=(9,)), "r")
    full = prefixes.settled(request, _result([5, 6], ["1", "1"]))
    assert full.finish_reason == "length" and prefixes.continuation(request, full) is None
    stopped = prefixes.settled(request, _result([9], ["1"]))
    assert stopped.finish_reason == "stop" and prefixes.continuation(request, stopped) is None
    short = _result([5], ["1"])
    assert prefixes.settled(request, short) is short
    assert prefixes.settled(request, None) is None
