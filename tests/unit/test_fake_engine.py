"""Contract of the engine records, the version-span expansion and the deterministic FakeEngine.

Checks: `expand_version_spans` turns SGLang's `[{'version','start','end'}]` into one version per
token and rejects gaps, overlaps and short coverage; the request/result records validate their
fields; `FakeEngine` is deterministic in (prompt, position, version), stops at stop/EOS tokens,
enforces the begin/update/end ordering, records calls in order, simulates a mid-sequence
version switch and a death. Also the parts of the SGLang engine that need no engine: its config
validation and the conversion of an SGLang output dict (log-probs, version spans) into a
`GenerateResult`. Nothing is faked beyond the engine itself.
"""

import pytest
import torch

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.engines.config import SGLangEngineConfig
from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import (
    INITIAL_VERSION,
    Engine,
    EngineDiedError,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    expand_version_spans,
)


def _request(rid="r0", prompt=(1, 2, 3), max_new_tokens=6, **sampling):
    return GenerateRequest(list(prompt), SamplingParams(max_new_tokens, **sampling), rid)


def test_expand_version_spans_one_version_per_token():
    spans = [
        {"version": "default", "start": 0, "end": 3},
        {"version": "v2", "start": 3, "end": 5},
    ]
    assert expand_version_spans(spans, 5) == ["default"] * 3 + ["v2"] * 2
    assert expand_version_spans([{"version": 7, "start": 0, "end": 2}], 2) == ["7", "7"]
    assert expand_version_spans([{"version": "v0", "start": 0, "end": 0}], 0) == []


@pytest.mark.parametrize(
    "spans, num_tokens, match",
    [
        ([{"version": "a", "start": 1, "end": 3}], 3, "not contiguous"),
        (
            [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 3, "end": 4}],
            4,
            "not contiguous",
        ),
        ([{"version": "a", "start": 0, "end": 2}], 3, "cover 2 tokens, expected 3"),
        ([{"version": "a", "start": 0, "end": -1}], 0, "not contiguous"),
    ],
)
def test_expand_version_spans_rejects_bad_spans(spans, num_tokens, match):
    with pytest.raises(ValueError, match=match):
        expand_version_spans(spans, num_tokens)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens = 0"),
        ({"temperature": -1.0}, "temperature = -1.0"),
        ({"top_p": 0.0}, "top_p = 0.0"),
        ({"top_k": 0}, "top_k = 0"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_ignore_eos_takes_no_stop_tokens():
    with pytest.raises(ValueError, match="ignore_eos with stop_token_ids = \\(7,\\)"):
        SamplingParams(stop_token_ids=(7,), ignore_eos=True)


def test_records_reject_inconsistent_fields():
    with pytest.raises(ValueError, match="input_ids is empty"):
        GenerateRequest([], SamplingParams(), "r")
    with pytest.raises(ValueError, match="2 output ids but 1 log-probs"):
        GenerateResult("r", [1, 2], [-0.1], ["v", "v"], "length")


def test_fake_engine_is_deterministic_and_satisfies_the_protocol():
    engine = FakeEngine(vocab_size=50)
    assert isinstance(engine, Engine)
    first = engine.generate([_request("a"), _request("b", prompt=(4, 5))])
    again = FakeEngine(vocab_size=50).generate([_request("a"), _request("b", prompt=(4, 5))])
    assert first == again
    assert [r.rid for r in first] == ["a", "b"]
    result = first[0]
    assert result.output_ids == [engine.token([1, 2, 3], i, INITIAL_VERSION) for i in range(6)]
    assert result.output_logprobs == [FakeEngine.logprob(t) for t in result.output_ids]
    assert result.token_versions == [INITIAL_VERSION] * 6
    assert result.finish_reason == "length"
    assert first[0].output_ids != first[1].output_ids


def test_fake_engine_stops_at_stop_and_eos_tokens():
    probe = FakeEngine()
    third = probe.token([1, 2, 3], 2, INITIAL_VERSION)
    stopped = FakeEngine().generate([_request(stop_token_ids=(third,))])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids[-1] == third and len(stopped.output_ids) <= 3
    eos = FakeEngine(eos_token_id=third).generate([_request()])[0]
    assert eos.finish_reason == "stop" and eos.output_ids[-1] == third
    ignored = FakeEngine(eos_token_id=third).generate([_request(ignore_eos=True)])[0]
    assert ignored.finish_reason == "length" and len(ignored.output_ids) == 6
    assert ignored.output_ids[2] == third  # emitted, not stopped at


def test_fake_engine_weight_update_ordering_and_versions():
    engine = FakeEngine()
    weight = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="between begin_weight_update"):
        engine.update_weights([("w", weight)], "v1")
    with pytest.raises(RuntimeError, match="no weight-update session is open"):
        engine.end_weight_update()
    engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="already open"):
        engine.begin_weight_update()
    engine.update_weights([("w", weight)], 1, flush_cache=False)
    engine.end_weight_update()
    assert engine.weight_version() == "1"
    assert torch.equal(engine.get_weights_by_name("w"), weight)
    with pytest.raises(KeyError, match="no weight 'missing'"):
        engine.get_weights_by_name("missing")
    result = engine.generate([_request()])[0]
    assert result.token_versions == ["1"] * 6
    assert result.output_ids == [engine.token([1, 2, 3], i, "1") for i in range(6)]
    assert engine.methods_called()[:8] == [
        "update_weights",
        "end_weight_update",
        "begin_weight_update",
        "begin_weight_update",
        "update_weights",
        "end_weight_update",
        "weight_version",
        "get_weights_by_name",
    ]
    assert engine.calls[4] == (
        "update_weights",
        {"names": ["w"], "version": "1", "flush_cache": False},
    )


def test_fake_engine_mid_sequence_version_switch():
    engine = FakeEngine()
    engine.switch_version_at(4, "v2")
    result = engine.generate([_request(max_new_tokens=6)])[0]
    assert result.token_versions == [INITIAL_VERSION] * 4 + ["v2"] * 2
    assert result.output_ids[4] == engine.token([1, 2, 3], 4, "v2")
    assert engine.weight_version() == "v2"


def test_fake_engine_pause_resume_abort_and_bad_mode():
    engine = FakeEngine()
    engine.pause("in_place")
    assert engine.paused == "in_place"
    engine.resume()
    assert engine.paused is None
    engine.abort("r0")
    engine.abort()
    engine.flush_cache()
    assert engine.calls[-3:] == [
        ("abort", {"rid": "r0"}),
        ("abort", {"rid": None}),
        ("flush_cache", {}),
    ]
    with pytest.raises(ValueError, match="pause mode = 'sideways'"):
        engine.pause("sideways")


def test_fake_engine_death_and_shutdown():
    engine = FakeEngine(name="fake-generate-0")
    assert engine.health()
    engine.kill("scheduler exited with code -9")
    assert not engine.health()
    with pytest.raises(EngineDiedError, match="fake-generate-0 died: scheduler exited"):
        engine.generate([_request()])
    other = FakeEngine()
    other.shutdown()
    assert not other.health()
    with pytest.raises(RuntimeError, match="was shut down; cannot call weight_version"):
        other.weight_version()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"device": "tpu"}, "engine.device = 'tpu': must be one of cpu, cuda"),
        ({"tp_size": 0}, "engine.tp_size = 0: must be an integer >= 1"),
        ({"tp_size": 3}, "SGLANG_CPU_OMP_THREADS_BIND = '0|1' names the cores of 2"),
        ({"call_timeout_s": 0}, "engine.call_timeout_s = 0: must be a finite number of seconds"),
        (
            {"process_start": "forkserver"},
            "engine.process_start = 'forkserver': must be one of auto, fork, spawn",
        ),
        (
            {"process_start": "fork", "device": "cuda"},
            "engine.process_start = 'fork': needs engine.device cpu, not cuda",
        ),
    ],
)
def test_sglang_engine_config_rejects_bad_values(kwargs, match, monkeypatch):
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")
    with pytest.raises(ConfigError, match=match):
        SGLangEngineConfig(model_path="m", **kwargs)


def test_sglang_processes_are_forked_on_cpu_and_spawned_on_cuda_unless_the_recipe_says():
    from megatron_async_rl.engines.config import EngineConfig

    def method(device, process_start="auto"):
        return EngineConfig(process_start=process_start).sglang_config("m", device, 0).start_method

    assert method("cpu") == "fork" and method("cuda") == "spawn"
    assert method("cpu", "spawn") == "spawn" and method("cuda", "spawn") == "spawn"
    with pytest.raises(ConfigError, match="engine.process_start = 'fork': needs engine.device"):
        method("cuda", "fork")
    with pytest.raises(ConfigError, match="process_start = 'vfork': must be one of"):
        EngineConfig(process_start="vfork")


def test_sglang_output_dict_becomes_a_result_with_per_token_versions():
    from megatron_async_rl.engines.sglang.host import _to_result

    meta = {
        "finish_reason": {"type": "length", "length": 3},
        "output_token_logprobs": [(-0.5, 7, None), (-1.0, 8, None), (-1.5, 9, None)],
        "weight_version": "v2",
        "weight_versions": [
            {"version": "v1", "start": 0, "end": 1},
            {"version": "v2", "start": 1, "end": 3},
        ],
    }
    result = _to_result("r", {"output_ids": [7, 8, 9], "meta_info": meta})
    assert result == GenerateResult(
        "r", [7, 8, 9], [-0.5, -1.0, -1.5], ["v1", "v2", "v2"], "length"
    )
    del meta["weight_versions"]  # older SGLang: one version for the whole request
    assert (
        _to_result("r", {"output_ids": [7, 8, 9], "meta_info": meta}).token_versions == ["v2"] * 3
    )
