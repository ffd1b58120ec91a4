"""Contract of `observability.trace`.

- `TraceRecorder` turns spans (`span()` blocks, `add()`) and `instant()` points into Trace Event
  Format events: `ph` X with `ts`/`dur` in microseconds of the recorder's clock, `pid` = rank,
  `tid` = stage lane, `cat` = role; plus `M` events naming the rank's process row
  (`rank 0 (train+logp)`) and each lane's thread row.
- `merge_traces` of 2 ranks x 3 stages gives `traceEvents` with metadata first and the rest in
  `ts` order, `displayTimeUnit` ms and a `metadata` dict; it passes `validate_trace`, and
  `write_trace` round-trips it through JSON unchanged.
- `validate_trace` rejects a malformed event with a ValueError naming its index and field.
- `max_events` keeps the newest events and reports how many were dropped.

Faked: the clock (a list of times popped in order). Nothing else; files go to `tmp_path`.
"""

import json

import pytest

from megatron_async_rl.observability.trace import (
    TraceRecorder,
    merge_traces,
    validate_trace,
    write_trace,
)


def fake_clock(*times: float):
    remaining = list(times)
    return lambda: remaining.pop(0)


def _two_ranks() -> list[list[dict]]:
    rank0 = TraceRecorder(0, ("train", "logp"), clock=fake_clock(10.0, 11.5, 12.0, 14.0))
    with rank0.span("logp", step=1):
        pass
    with rank0.span("train", step=1):
        pass
    rank0.add("param_update", 14.0, 14.25)
    rank1 = TraceRecorder(1, ("generate",), clock=fake_clock(9.0, 13.0, 13.5))
    rank1.add("dataloader", 8.5, 9.0)
    with rank1.span("generate", step=2):
        pass
    rank1.add("reward", 13.0, 13.2, role="reward")
    rank1.instant("weights_loaded", version=1)
    return [rank0.events(), rank1.events()]


def test_two_ranks_three_stages_merge_and_validate():
    trace = merge_traces(_two_ranks())
    validate_trace(trace)
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    phases = [e["ph"] for e in events]
    assert phases == sorted(phases, key=lambda ph: ph != "M")  # metadata rows first
    timed = [e for e in events if e["ph"] != "M"]
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)
    spans = {(e["pid"], e["name"]): e for e in timed if e["ph"] == "X"}
    assert len(spans) == 6
    assert spans[0, "train"] == {
        "name": "train",
        "cat": "train",
        "ph": "X",
        "ts": 12.0e6,
        "dur": 2.0e6,
        "pid": 0,
        "tid": 2,
        "args": {"step": 1},
    }
    # cat: the stage when it names a role, else the only role, else "stage"; role= overrides.
    assert spans[0, "logp"]["cat"] == "logp" and spans[0, "logp"]["dur"] == 1.5e6
    assert spans[0, "param_update"]["cat"] == "stage"
    assert spans[1, "dataloader"]["cat"] == "generate"
    assert spans[1, "reward"]["cat"] == "reward"
    (point,) = [e for e in timed if e["ph"] == "i"]
    assert point == {
        "name": "weights_loaded",
        "cat": "event",
        "ph": "i",
        "ts": 13.5e6,
        "s": "t",
        "pid": 1,
        "tid": 0,
        "args": {"version": 1},
    }
    assert trace["metadata"]["ranks"] == [0, 1]
    assert trace["metadata"]["num_dropped_events"] == 0


def test_metadata_rows_name_ranks_and_stage_lanes():
    meta = [e for e in merge_traces(_two_ranks())["traceEvents"] if e["ph"] == "M"]
    names = {(e["name"], e["pid"], e["tid"]): e["args"] for e in meta}
    assert names["process_name", 0, 0] == {"name": "rank 0 (train+logp)"}
    assert names["process_name", 1, 0] == {"name": "rank 1 (generate)"}
    assert names["process_sort_index", 1, 0] == {"sort_index": 1}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert lanes == {
        (0, 1): "logp",
        (0, 2): "train",
        (0, 3): "param_update",
        (1, 0): "events",
        (1, 1): "dataloader",
        (1, 2): "generate",
        (1, 3): "reward",
    }


def test_stages_fix_lane_order_and_span_survives_an_exception():
    recorder = TraceRecorder(2, ("ref",), clock=fake_clock(1.0, 3.0), stages=("ref_logp", "x"))
    with pytest.raises(RuntimeError, match="boom"), recorder.span("x"):
        raise RuntimeError("boom")
    (event,) = [e for e in recorder.events() if e["ph"] == "X"]
    assert (event["tid"], event["dur"]) == (2, 2.0e6)
    assert recorder.spans() == [dict(stage="x", rank=2, start_s=1.0, end_s=3.0)]


def test_json_round_trip(tmp_path):
    trace = merge_traces(_two_ranks())
    path = write_trace(tmp_path / "run" / "trace.json", trace)
    loaded = json.loads(path.read_text())
    assert loaded == trace
    validate_trace(loaded)
    validate_trace(loaded["traceEvents"])  # the array form is a trace too


def test_max_events_drops_the_oldest_and_reports_it():
    recorder = TraceRecorder(0, ("train",), max_events=3)
    for i in range(5):
        recorder.add("train", float(i), i + 0.5)
    kept = [e["ts"] for e in recorder.events() if e["ph"] == "X"]
    assert kept == [2e6, 3e6, 4e6]
    assert recorder.dropped == 2
    metadata = merge_traces([recorder.events()])["metadata"]
    assert metadata["dropped_events"] == {"0": 2}
    assert metadata["num_dropped_events"] == 2


GOOD = {"name": "train", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 0, "tid": 1, "args": {}}


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"dur": None}, r"event 1: field 'dur' must be a finite number"),
        ({"dur": -1.0}, r"event 1: field 'dur' must be >= 0"),
        ({"ts": "12"}, r"event 1: field 'ts' must be a finite number"),
        ({"ts": float("nan")}, r"event 1: field 'ts' must be a finite number"),
        ({"name": 7}, r"event 1: field 'name' must be a string"),
        ({"pid": True}, r"event 1: field 'pid' must be an int or a string"),
        ({"ph": "Q"}, r"event 1: field 'ph' must be one of"),
        ({"args": [1]}, r"event 1: field 'args' must be a dict"),
        ({"args": {"t": object()}}, r"event 1: field 'args' must be JSON-serializable"),
        ({"cat": 3}, r"event 1: field 'cat' must be a string"),
    ],
)
def test_validate_rejects_bad_fields(change, match):
    with pytest.raises(ValueError, match=match):
        validate_trace({"traceEvents": [GOOD, {**GOOD, **change}]})


@pytest.mark.parametrize(
    ("event", "match"),
    [
        ({k: v for k, v in GOOD.items() if k != "dur"}, r"event 0: field 'dur' is required"),
        ({"name": "i", "ph": "i", "pid": 0, "tid": 0}, r"event 0: field 'ts' is required"),
        ({"name": "thread_name", "ph": "M", "pid": 0}, r"event 0: field 'args' is required"),
        (
            {"name": "process_name", "ph": "M", "pid": 0, "args": {}},
            r"event 0: field 'args' of process_name needs a string 'name'",
        ),
        ("not an event", r"event 0: must be a dict"),
    ],
)
def test_validate_rejects_missing_fields(event, match):
    with pytest.raises(ValueError, match=match):
        validate_trace([event])


def test_validate_rejects_bad_containers():
    with pytest.raises(ValueError, match="'traceEvents' list"):
        validate_trace({"events": []})
    with pytest.raises(ValueError, match="displayTimeUnit must be 'ms' or 'ns', got 's'"):
        validate_trace({"traceEvents": [], "displayTimeUnit": "s"})
    with pytest.raises(ValueError, match="dict or a list of events, got str"):
        validate_trace("trace")


def test_recorder_and_merge_misuse():
    with pytest.raises(ValueError, match="max_events must be an int >= 1, got 0"):
        TraceRecorder(0, ("train",), max_events=0)
    with pytest.raises(ValueError, match="'train' on rank 0 needs finite start_s <= end_s"):
        TraceRecorder(0, ("train",)).add("train", 2.0, 1.0)
    events = TraceRecorder(3, ("ref",)).events()
    with pytest.raises(ValueError, match="pid 3 has events in lists 0 and 1"):
        merge_traces([events, events])


def test_spans_since_are_the_spans_ending_after_it():
    clock = iter(range(100)).__next__
    recorder = TraceRecorder(0, ("train",), clock=lambda: float(clock()))
    for step in range(10):
        with recorder.span("train", step=step):
            pass
    recorder.instant("weights_loaded")
    for since in (0.0, 7.5, 13.0, 19.0, 50.0):
        expected = [s for s in recorder.spans() if s["end_s"] > since]
        assert recorder.spans(since_s=since) == expected, since
