"""Bounded off-policy (`scheduler.staleness`).

Contract checked: generation for train step k is admitted once the engines hold version >= k - N
and refused before; engines already past k is a scheduler bug (RuntimeError); `check_batch`
accepts any token lag 0..N, rejects lag N + 1 and versions newer than k with a message naming the
step, the sample, the version and the window [k - N, k]; N = 0 accepts version k only; the lag
histogram has a key for every lag 0..N and sums to 1; a schedule that generates as far ahead as
admission allows, with in-flight updates, never breaks the bound. N is validated as a recipe key.
Nothing is faked.
"""

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.scheduler.staleness import StalenessController


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_generate_ahead_steps_is_validated(bad):
    pattern = r"scheduler.generate_ahead_steps = .*: must be an integer >= 0"
    with pytest.raises(ConfigError, match=pattern) as info:
        StalenessController(bad)
    assert info.value.key == "scheduler.generate_ahead_steps"


@pytest.mark.parametrize("n", [0, 1, 3])
def test_admission(n):
    ctl = StalenessController(n)
    for step in range(8):
        assert ctl.required_version(step) == max(0, step - n)
        assert ctl.window(step) == (max(0, step - n), step)
        for version in range(step + 1):
            assert ctl.can_generate(step, version) == (version >= step - n)
    assert ctl.last_admissible_step(4) == 4 + n
    assert ctl.can_generate(4 + n, 4) and (n == 0 or not ctl.can_generate(5 + n, 4))


def test_engines_past_the_step_is_a_bug():
    with pytest.raises(RuntimeError, match=r"train step 2: engines hold policy version 3, newer"):
        StalenessController(1).can_generate(2, 3)
    with pytest.raises(RuntimeError, match="must be >= 0"):
        StalenessController(1).can_generate(-1, 0)


@pytest.mark.parametrize("n", [0, 1, 2, 4])
def test_every_lag_up_to_n_is_accepted(n):
    step = 10
    samples = [[step - lag] * (lag + 1) for lag in range(n + 1)]  # lag L on L + 1 tokens
    metrics = StalenessController(n).check_batch(step, samples)
    num_tokens = sum(len(s) for s in samples)
    assert metrics["policy_lag/max"] == n
    assert metrics["policy_lag/mean"] == pytest.approx(
        sum(lag * (lag + 1) for lag in range(n + 1)) / num_tokens
    )
    hist = {k: v for k, v in metrics.items() if k.startswith("policy_lag/hist/")}
    assert list(hist) == [f"policy_lag/hist/{lag}" for lag in range(n + 1)]
    assert sum(hist.values()) == pytest.approx(1.0)
    for lag in range(n + 1):
        assert hist[f"policy_lag/hist/{lag}"] == pytest.approx((lag + 1) / num_tokens)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_lag_n_plus_one_is_rejected(n):
    step = 7
    samples = [[step] * 4, [step, step - n - 1, step]]
    pattern = (
        rf"^train step 7: sample 1 has a token from policy version {step - n - 1}, outside the "
        rf"window \[{step - n}, 7\] \(lag {n + 1} > generate_ahead_steps {n}; "
        rf"scheduler.generate_ahead_steps = {n}\)$"
    )
    with pytest.raises(RuntimeError, match=pattern):
        StalenessController(n).check_batch(step, samples)


def test_version_newer_than_the_step_is_rejected():
    with pytest.raises(
        RuntimeError,
        match=r"train step 3: sample 0 has a token from policy version 4, outside the window "
        r"\[1, 3\] \(newer than the weights being trained",
    ):
        StalenessController(2).check_batch(3, [[3, 4]])


def test_zero_steps_ahead_is_synchronous():
    ctl = StalenessController(0)
    metrics = ctl.check_batch(5, [[5, 5, 5], [5]])
    assert metrics == {
        "policy_lag/max": 0.0,
        "policy_lag/mean": 0.0,
        "policy_lag/mixed_samples": 0.0,
        "policy_lag/hist/0": 1.0,
    }
    with pytest.raises(RuntimeError, match=r"version 4, outside the window \[5, 5\]"):
        ctl.check_batch(5, [[5], [5, 4]])
    assert not ctl.can_generate(5, 4) and ctl.can_generate(5, 5)


def test_early_steps_window_starts_at_zero():
    metrics = StalenessController(3).check_batch(1, [[0, 1], [0]])
    assert metrics["policy_lag/hist/1"] == pytest.approx(2 / 3)
    assert metrics["policy_lag/hist/2"] == metrics["policy_lag/hist/3"] == 0.0
    assert metrics["policy_lag/mixed_samples"] == 1.0


def test_empty_samples_give_zero_lags():
    metrics = StalenessController(1).check_batch(4, [[], []])
    assert metrics["policy_lag/max"] == metrics["policy_lag/mean"] == 0.0
    assert metrics["policy_lag/hist/0"] == metrics["policy_lag/hist/1"] == 0.0


def run_schedule(admit: StalenessController, check: StalenessController, num_steps=8):
    """Generation starts every batch as soon as `admit` allows and extends every started batch
    by one token per train step at the engines' current version; each new version is loaded in
    flight (batches in progress continue with it). Returns the max lag `check` reports."""
    engine_version, next_gen, in_progress, max_lag = 0, 0, {}, 0.0
    for step in range(num_steps):
        while next_gen < num_steps and admit.can_generate(next_gen, engine_version):
            in_progress[next_gen] = [[] for _ in range(3)]
            next_gen += 1
        for batch in in_progress.values():
            for sample in batch:
                sample.append(engine_version)
        metrics = check.check_batch(step, in_progress.pop(step))
        max_lag = max(max_lag, metrics["policy_lag/max"])
        engine_version = step + 1  # train step k publishes version k + 1
    return max_lag


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_greedy_schedule_with_in_flight_updates_stays_in_the_window(n):
    ctl = StalenessController(n)
    assert run_schedule(ctl, ctl) == n  # the bound is reached, never passed


@pytest.mark.parametrize("n", [0, 1, 2])
def test_admitting_one_step_too_early_is_caught_where_samples_are_consumed(n):
    with pytest.raises(RuntimeError, match=rf"lag {n + 1} > generate_ahead_steps {n}"):
        run_schedule(StalenessController(n + 1), StalenessController(n))
