"""Contract of `observability.utilization`.

- `busy_idle` measures each rank's busy seconds as the union of its spans clipped to the window
  (overlapping stages on one rank count once), averages them per rank group (`train+logp`),
  counts a rank without spans as idle, and gives `utilization/<group>/{busy_s,idle_s,
  bubble_ratio}` plus `utilization/bubble_ratio` = all ranks' idle seconds / (ranks * window).
  The expected numbers are worked out by hand in the comments below.
- `ideal_step_s` is the largest group busy time; `overlap_efficiency` is ideal / actual.
- `policy_lag_histogram` gives `policy_lag/hist/<k>` fractions for k = 0..max_lag summing to 1,
  the last bucket collecting larger lags.
- Bad windows, spans, lags and step times are ValueErrors naming the value.

Faked: the clock of `RankClock` (a list of times) in the one test that feeds it real spans.
"""

import numpy as np
import pytest

from megatron_async_rl.observability.clock import RankClock
from megatron_async_rl.observability.utilization import (
    busy_idle,
    ideal_step_s,
    overlap_efficiency,
    policy_lag_histogram,
)
from megatron_async_rl.scheduler.states import Stage, StageState

ROLES = {
    0: ("train", "logp"),
    1: ("train", "logp"),
    2: ("generate",),
    3: ("generate",),
    4: ("ref",),
}


def span(stage, rank, start_s, end_s):
    return dict(stage=stage, rank=rank, start_s=start_s, end_s=end_s)


SPANS = [
    # rank 0: train [1,4) and logp [3,6) overlap -> [1,6) = 5 s; [9,12) clipped to [9,10) = 1 s.
    span("train", 0, 1.0, 4.0),
    span("logp", 0, 3.0, 6.0),
    span("train", 0, 9.0, 12.0),
    # rank 1: 2 s busy.
    span("train", 1, 0.0, 2.0),
    # rank 2: [-1,3) clipped to [0,3) = 3 s, plus [5,8) = 3 s; a span after the window is ignored.
    span("generate", 2, -1.0, 3.0),
    span("generate", 2, 5.0, 8.0),
    span("generate", 2, 10.0, 11.0),
    # rank 3: nothing, idle for the whole window. rank 4: [4,5) nested in [2,7) -> 5 s.
    span("ref_logp", 4, 2.0, 7.0),
    span("ref_logp", 4, 4.0, 5.0),
]


def test_busy_idle_against_hand_numbers():
    metrics = busy_idle(SPANS, 0.0, 10.0, ROLES)
    assert metrics == pytest.approx(
        {
            # busy: mean of rank 0 (6 s) and rank 1 (2 s).
            "utilization/train+logp/busy_s": 4.0,
            "utilization/train+logp/idle_s": 6.0,
            "utilization/train+logp/bubble_ratio": 0.6,
            # busy: mean of rank 2 (6 s) and rank 3 (0 s).
            "utilization/generate/busy_s": 3.0,
            "utilization/generate/idle_s": 7.0,
            "utilization/generate/bubble_ratio": 0.7,
            "utilization/ref/busy_s": 5.0,
            "utilization/ref/idle_s": 5.0,
            "utilization/ref/bubble_ratio": 0.5,
            # idle 4 + 8 + 4 + 10 + 5 = 31 s over 5 ranks x 10 s; = (2*0.6 + 2*0.7 + 0.5) / 5.
            "utilization/bubble_ratio": 0.62,
        }
    )


def test_busy_idle_on_the_clock_of_stage_machines():
    # one clock: a rank's machines report their spans; timings, trace and utilization agree
    now = [100.0]
    clock = RankClock(0, ("train", "logp"), clock=lambda: now[0])
    train, logp = clock.machine(Stage.TRAIN), clock.machine(Stage.LOGP)

    def at(t, machine, state, **step):
        now[0] = t
        machine.transition(state, "test", **step)

    at(100.0, logp, StageState.RUNNING, step=3)  # 100 -> 101 busy
    at(101.0, logp, StageState.IDLE)
    at(101.0, train, StageState.WAITING_INPUT, step=3)  # 101 -> 102 waiting
    at(102.0, train, StageState.RUNNING)  # 102 -> 104 busy
    at(104.0, train, StageState.IDLE)
    now[0] = 105.0
    assert clock.timings(3) == {"timing/logp_s": 1.0, "timing/train_s": 2.0}
    assert clock.timings(3) == {}, "timings are taken once"
    spans = clock.trace.spans()
    assert [(s["stage"], s["start_s"], s["end_s"]) for s in spans] == [
        ("logp", 100.0, 101.0),
        ("train", 102.0, 104.0),
    ]
    metrics = clock.utilization()  # window 100 -> 105
    assert metrics["utilization/train+logp/busy_s"] == pytest.approx(3.0)
    assert metrics["utilization/bubble_ratio"] == pytest.approx(0.4)
    assert busy_idle(spans, 100.0, 105.0, {0: ("train", "logp")}) == metrics


def test_a_learn_stage_of_a_role_the_rank_does_not_hold_is_not_busy():
    # a train-only rank runs the logp stage too (the batch's layout): not its busy time
    now = [100.0]
    clock = RankClock(0, ("train",), clock=lambda: now[0])
    train, logp = clock.machine(Stage.TRAIN), clock.machine(Stage.LOGP)
    for t, machine, state in ((100.0, logp, StageState.RUNNING), (101.0, logp, StageState.IDLE),
                              (102.0, train, StageState.RUNNING),
                              (104.0, train, StageState.IDLE)):  # fmt: skip
        now[0] = t
        machine.transition(state, "test", step=3)
    now[0] = 105.0
    assert clock.timings(3) == {"timing/logp_s": 1.0, "timing/train_s": 2.0}  # all kept
    assert [s["stage"] for s in clock.trace.spans()] == ["logp", "train"]
    assert clock.utilization()["utilization/train/busy_s"] == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("spans", "window", "roles", "match"),
    [
        ([], (5.0, 5.0), ROLES, r"window_start_s < window_end_s, got 5.0 and 5.0"),
        ([], (0.0, 1.0), {}, r"roles_of_rank for at least one rank"),
        ([span("train", 7, 0.0, 1.0)], (0.0, 1.0), ROLES, r"span 0 is on rank 7"),
        ([span("train", 0, 2.0, 1.0)], (0.0, 1.0), ROLES, r"span 0 ends before it starts"),
        ([dict(stage="train", rank=0)], (0.0, 1.0), ROLES, r"span 0 lacks field\(s\) \['start_s'"),
    ],
)
def test_busy_idle_rejects_bad_input(spans, window, roles, match):
    with pytest.raises(ValueError, match=match):
        busy_idle(spans, *window, roles)


def test_ideal_bound_and_efficiency():
    busy = {k: v for k, v in busy_idle(SPANS, 0.0, 10.0, ROLES).items() if k.endswith("/busy_s")}
    assert ideal_step_s(busy) == pytest.approx(5.0)  # ref, the busiest group
    assert ideal_step_s({"train+logp": 4.0, "generate": 6.5}) == 6.5
    assert overlap_efficiency(5.0, 8.0) == pytest.approx(0.625)
    assert overlap_efficiency(8.0, 8.0) == 1.0
    with pytest.raises(ValueError, match="at least one group"):
        ideal_step_s({})
    with pytest.raises(ValueError, match="busy seconds of 'ref' must be finite and >= 0, got -1"):
        ideal_step_s({"ref": -1.0})
    with pytest.raises(ValueError, match="actual_step_s must be finite and > 0, got 0"):
        overlap_efficiency(1.0, 0.0)
    with pytest.raises(ValueError, match=r"ideal_s must be in \[0, actual_step_s=2.0\].*got 3.0"):
        overlap_efficiency(3.0, 2.0)


def test_policy_lag_histogram():
    hist = policy_lag_histogram([0, 0, 1, 3, np.int64(5)], max_lag=3)
    # 5 samples: lag 0 twice, 1 once, 3 once, and 5 > max_lag lands in the last bucket.
    assert hist == pytest.approx(
        {
            "policy_lag/hist/0": 0.4,
            "policy_lag/hist/1": 0.2,
            "policy_lag/hist/2": 0.0,
            "policy_lag/hist/3": 0.4,
        }
    )
    assert sum(hist.values()) == pytest.approx(1.0)
    assert policy_lag_histogram([2], max_lag=0) == {"policy_lag/hist/0": 1.0}


@pytest.mark.parametrize(
    ("lags", "max_lag", "match"),
    [
        ([0, -1], 2, r"lag 1 must be an int >= 0 \(policy versions\), got -1"),
        ([0.5], 2, r"lag 0 must be an int >= 0"),
        ([True], 2, r"lag 0 must be an int >= 0"),
        ([], 2, r"at least one lag"),
        ([0], -1, r"max_lag must be an int >= 0, got -1"),
    ],
)
def test_policy_lag_histogram_rejects_bad_input(lags, max_lag, match):
    with pytest.raises(ValueError, match=match):
        policy_lag_histogram(lags, max_lag)
