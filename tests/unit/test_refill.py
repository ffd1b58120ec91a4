"""Dynamic sampling with refill: the plan (`rollout/refill.py`), the engine hosts' agreement, the
knobs, and the generate side's rounds (`roles/generate.py`).

Contracts checked:
- a group is informative when its rewards differ; a group missing a sample is an error;
- `RefillPlan.decide` keeps the first informative groups in draw order up to the target, drops
  and counts the zero-variance ones and the informative ones beyond the target, and asks for
  another round while short; after the last round allowed it pads with the earliest
  zero-variance groups (`pad`) or raises naming the knob (`error`); the metrics are the counts
  written out by hand here; a plan saved mid-step and restored decides as one never saved;
- `StoreRounds` over a real `torch.distributed.HashStore`: nothing until every host posted,
  then the merged flags; a prompt posted by two hosts is an error; a host's keys of step s - 2
  are deleted when it posts for step s; a wait that runs out names the hosts missing;
- the `algorithm.refill*` knobs: each bad value is a one-line `ConfigError` naming the key
  (`algorithm.<key>` through the recipe loader); a recipe with refill on resolves;
- two engine hosts (`GenerateSide`, engine index 0 and 1) running a step's rounds in two
  threads agree on every round: together they hold exactly the target's informative groups,
  renumbered 0..target-1, and their data cursors are equal afterwards;
- resume: the cursor after a refill step restores the same next prompts in a fresh generate
  side, and a step saved between rounds (its `StepWork` state) finishes with the same batch;
  hosts resumed a round apart agree (a host posts its share of the rounds decided again);
- multi-turn (`environment:`) trajectories refill the same way (their loss masks kept).
Faked: the engine (`FakeEngine`) and the reward (`ScriptedReward`: the test chooses which
prompts are informative; the multi-turn test's environment is test_agentic's `EchoTwice`);
dataset, plan, store and generate side are the package's own.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_async_rl.algorithms.config import GRPOConfig
from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.roles.work import StepWork
from megatron_async_rl.rollout.refill import (
    LocalRounds,
    RefillPlan,
    StoreRounds,
    informative_groups,
    wait_for_round,
)
from tests.unit.pipeline_fakes import ScriptedReward, every_third, make_cfg, make_generate_side


def _samples(rewards_by_prompt: dict[int, list[float]]):
    return [SimpleNamespace(prompt_index=i, sample_index=k, reward=r)
            for i, rewards in rewards_by_prompt.items() for k, r in enumerate(rewards)]  # fmt: skip


def test_a_group_is_informative_when_its_rewards_differ():
    flags = informative_groups(_samples({3: [1, 0], 1: [1, 1], 2: [0.5, 0.5]}), 2)
    assert flags == {1: False, 2: False, 3: True}
    with pytest.raises(RuntimeError, match=r"groups \[1\] have \[1\] samples"):
        informative_groups(_samples({0: [1, 0], 1: [1]}), 2)


def test_the_first_informative_groups_are_kept_in_draw_order_and_the_rest_counted():
    plan = RefillPlan(target=3, max_rounds=5, pad=True)
    first = plan.decide({0: True, 1: False, 2: False, 3: True})  # 2 of 3: short
    assert not first.done and plan.kept == [0, 3] and plan.fillers == [1]
    second = plan.decide({4: False, 5: True, 6: True, 7: True})  # needs 1: keeps 5
    assert second.done and not second.exhausted
    assert plan.kept == [0, 3, 5] and plan.batch_order() == [0, 3, 5]
    assert plan.holding() == {0, 3, 5}  # fillers are no longer needed
    assert plan.metrics() == {
        "dynamic_sampling/groups_sampled": 8.0,
        "dynamic_sampling/groups_kept": 3.0,
        "dynamic_sampling/groups_dropped_zero_variance": 3.0,  # 1, 2, 4
        "dynamic_sampling/groups_dropped_extra": 2.0,  # 6, 7
        "dynamic_sampling/groups_padded": 0.0,
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/extra_generation_frac": (8 - 3) / 3,
    }


def test_a_round_with_enough_groups_completes_the_step_at_once():
    plan = RefillPlan(target=2, max_rounds=3, pad=False)
    assert plan.decide({0: True, 1: True}).done
    assert plan.metrics()["dynamic_sampling/extra_generation_frac"] == 0.0


def test_short_after_the_last_round_pads_with_the_earliest_zero_variance_groups():
    plan = RefillPlan(target=3, max_rounds=2, pad=True)
    assert not plan.decide({0: False, 1: True, 2: False}).done
    decision = plan.decide({3: False, 4: False, 5: False})
    assert decision.done and decision.exhausted
    assert plan.batch_order() == [0, 1, 2]  # kept 1, padded with 0 and 2 (the earliest)
    assert plan.metrics()["dynamic_sampling/groups_padded"] == 2.0
    assert plan.metrics()["dynamic_sampling/groups_dropped_zero_variance"] == 3.0  # 3, 4, 5


def test_short_after_the_last_round_with_error_stops_naming_the_knob():
    plan = RefillPlan(target=2, max_rounds=2, pad=False)
    plan.decide({0: False, 1: False})
    with pytest.raises(RuntimeError, match=r"0 informative groups of 2 after 2 rounds "
                       r"\(algorithm.max_refill_rounds = 1"):  # fmt: skip
        plan.decide({2: False, 3: False})


def test_a_plan_saved_between_rounds_decides_as_one_never_saved():
    rounds = [{0: False, 1: True}, {2: False, 3: False}, {4: True, 5: True}]
    whole = RefillPlan(target=2, max_rounds=4, pad=True)
    for flags in rounds:
        whole.decide(flags)
    saved = RefillPlan(target=2, max_rounds=4, pad=True)
    saved.decide(rounds[0])
    restored = RefillPlan.from_state_dict(saved.state_dict())
    for flags in rounds[1:]:
        restored.decide(flags)
    assert restored == whole and restored.batch_order() == [1, 4]


def test_store_rounds_merge_every_hosts_flags_once_all_posted():
    store = dist.HashStore()
    hosts = [StoreRounds(dist.PrefixStore("refill", store), i, 2) for i in range(2)]
    for host in hosts:
        host.POLL_S = 0.0
    hosts[0].post(5, 0, {0: True, 2: False})
    assert hosts[0].gather(5, 0) is None and hosts[0].missing(5, 0) == [1]
    hosts[1].post(5, 0, {1: False, 3: True})
    hosts[1].post(5, 0, {1: False, 3: True})  # again: harmless
    merged = {0: True, 1: False, 2: False, 3: True}
    assert hosts[0].gather(5, 0) == merged == hosts[1].gather(5, 0)
    # a host's keys of step s - 2 go when it posts for step s
    hosts[0].post(7, 0, {0: True})
    assert not store.check(["refill/5/0/0"]) and store.check(["refill/5/0/1"])


def test_a_prompt_posted_by_two_hosts_is_an_error():
    store = dist.HashStore()
    hosts = [StoreRounds(store, i, 2) for i in range(2)]
    hosts[0].post(0, 0, {0: True})
    hosts[1].post(0, 0, {0: False})
    with pytest.raises(RuntimeError, match="engine host 1 posted prompt 0 of step 0, round 0"):
        hosts[0].gather(0, 0)


def test_a_wait_for_a_round_that_runs_out_names_the_missing_hosts():
    rounds = StoreRounds(dist.HashStore(), 0, 3)
    rounds.post(2, 1, {0: True})
    with pytest.raises(RuntimeError, match=r"step 2: no refill flags of round 1 from engine "
                       r"hosts \[1, 2\] within 0.05 s"):  # fmt: skip
        wait_for_round(rounds, 2, 1, 0.05, "generate rank (engine 0)")
    local = LocalRounds()
    local.post(2, 1, {0: True})
    assert wait_for_round(local, 2, 1, 0.05, "x") == {0: True}


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"refill": True}, r"refill = True: needs dynamic_filtering: true"),
        ({"refill": "yes"}, r"refill = 'yes': must be true or false"),
        ({"max_refill_rounds": 0}, r"max_refill_rounds = 0: must be an integer >= 1"),
        ({"refill_exhausted": "shrink"}, r"refill_exhausted = 'shrink': must be one of pad, err"),
    ],
)
def test_bad_refill_knobs_are_one_line_errors_naming_the_key(knobs, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(**knobs)


def test_the_refill_knobs_default_off_and_existing_recipes_stay_valid():
    algo = GRPOConfig(dynamic_filtering=True)
    assert (algo.refill, algo.max_refill_rounds, algo.refill_exhausted) == (False, 10, "pad")
    assert GRPOConfig(dynamic_filtering=True, refill=True).refill


def _step(side, step: int, timeout_s: float = 10.0) -> StepWork:
    """A step's rounds on one generate side, as the synchronous loop runs them."""
    work = side.load(step)
    while True:
        side.score(side.generate(work))
        if side.settle(work, side.wait_round(work, timeout_s)):
            return work


def test_two_engine_hosts_agree_on_every_round_and_keep_their_cursors_equal(tmp_path):
    cfg = make_cfg(tmp_path, steps=3, ahead=0, refill=True, prompts=3, samples=2)
    store = dist.HashStore()
    sides = [
        make_generate_side(cfg, FakeEngine(), ScriptedReward(every_third), i, 2,
                           StoreRounds(dist.PrefixStore("refill", store), i, 2))
        for i in range(2)
    ]  # fmt: skip
    works: dict[tuple[int, int], StepWork] = {}
    errors = []

    def host(index):
        try:
            for step in range(3):
                works[index, step] = _step(sides[index], step)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    threads = [threading.Thread(target=host, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert sides[0].dataset.cursor == sides[1].dataset.cursor
    rounds = []
    for step in range(3):
        a, b = works[0, step], works[1, step]
        assert a.refill == b.refill  # one plan, reached on both hosts
        samples = sorted(a.samples + b.samples, key=lambda s: (s.prompt_index, s.sample_index))
        assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
        assert all(every_third(s.uid) for s in samples)
        assert informative_groups(samples, 2) == {0: True, 1: True, 2: True}
        assert a.refill.metrics()["dynamic_sampling/groups_kept"] == 3
        rounds.append(a.refill.rounds)
    assert max(rounds) > 1, "no step needed a refill round: the test checks nothing"


def test_the_cursor_after_a_refill_step_restores_the_same_next_prompts(tmp_path):
    cfg = make_cfg(tmp_path, steps=3, ahead=0, refill=True, prompts=3, samples=2)
    side = make_generate_side(cfg, FakeEngine(), ScriptedReward(every_third))
    first = _step(side, 0)
    assert first.refill.rounds > 1
    saved = side.dataset.state_dict()
    on = _step(side, 1)
    fresh = make_generate_side(cfg, FakeEngine(), ScriptedReward(every_third))
    fresh.dataset.load_state_dict(saved)
    resumed = _step(fresh, 1)
    assert [r.uid for r in resumed.records] == [r.uid for r in on.records]
    assert [s.to_dict() for s in resumed.samples] == [s.to_dict() for s in on.samples]
    assert resumed.cursor == on.cursor == saved["cursor"]
    assert fresh.dataset.state_dict() == side.dataset.state_dict()


def test_a_step_saved_between_rounds_finishes_with_the_same_batch(tmp_path):
    cfg = make_cfg(tmp_path, steps=3, ahead=0, refill=True, prompts=3, samples=2)
    whole_side = make_generate_side(cfg, FakeEngine(), ScriptedReward(every_third))
    whole = _step(whole_side, 0)
    side = make_generate_side(cfg, FakeEngine(), ScriptedReward(every_third))
    work = side.load(0)
    side.score(side.generate(work))
    assert not side.settle(work, side.wait_round(work, 1.0)), "round 0 completed the step"
    state, cursor = work.state_dict(), side.dataset.state_dict()
    fresh = make_generate_side(cfg, FakeEngine(), ScriptedReward(every_third))
    fresh.dataset.load_state_dict(cursor)
    work = StepWork.from_state_dict(state)
    while True:
        fresh.score(fresh.generate(work))
        if fresh.settle(work, fresh.wait_round(work, 1.0)):
            break
    assert [s.to_dict() for s in work.samples] == [s.to_dict() for s in whole.samples]
    assert work.refill == whole.refill
    assert fresh.dataset.state_dict() == whole_side.dataset.state_dict()


def _finish(side, work: StepWork, settle_first: bool, timeout_s: float = 10.0) -> StepWork:
    """The rest of a step's rounds from a saved `work`: scored and not yet settled
    (`settle_first`), or with a round to generate."""
    while True:
        if not settle_first:
            side.score(side.generate(work))
        settle_first = False
        if side.settle(work, side.wait_round(work, timeout_s)):
            return work


def _hosts(cfg, store):
    return [make_generate_side(cfg, FakeEngine(), ScriptedReward(every_third), i, 2,
                               StoreRounds(dist.PrefixStore("refill", store), i, 2))
            for i in range(2)]  # fmt: skip


def _in_threads(*calls):
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return results


def test_hosts_resumed_a_round_apart_post_the_round_decided_again_and_agree(tmp_path):
    # Host 0 had decided round 0 and drawn round 1 when the save came; host 1 had posted its
    # round 0 flags but not read host 0's. The resumed run has a new store: host 0 posts its
    # share of round 0 again (from the plan's history), so host 1 is not left waiting.
    cfg = make_cfg(tmp_path, steps=1, ahead=0, refill=True, prompts=3, samples=2)
    ref = _hosts(cfg, dist.HashStore())
    whole = _in_threads(*[lambda side=side: _step(side, 0) for side in ref])
    assert whole[0].refill.rounds > 1
    sides = _hosts(cfg, dist.HashStore())
    works = [side.load(0) for side in sides]
    for side, work in zip(sides, works):
        side.score(side.generate(work))
    sides[1].round_flags(works[1])
    assert not sides[0].settle(works[0], sides[0].wait_round(works[0], 1.0))
    saved = [(work.state_dict(), side.dataset.state_dict()) for side, work in zip(sides, works)]
    resumed = _hosts(cfg, dist.HashStore())
    for side, (_, cursor) in zip(resumed, saved):
        side.dataset.load_state_dict(cursor)
    works = [StepWork.from_state_dict(state) for state, _ in saved]
    done = _in_threads(lambda: _finish(resumed[0], works[0], settle_first=False),
                       lambda: _finish(resumed[1], works[1], settle_first=True))  # fmt: skip
    for got, want in zip(done, whole):
        assert [s.to_dict() for s in got.samples] == [s.to_dict() for s in want.samples]
        assert got.refill == want.refill
    assert resumed[0].dataset.cursor == resumed[1].dataset.cursor == ref[0].dataset.cursor


def test_multi_turn_trajectories_refill_the_same_way(tmp_path):
    from megatron_async_rl.models.tiny import build_tokenizer
    from megatron_async_rl.roles.generate import GenerateSide
    from megatron_async_rl.rollout.agentic import MultiTurnRollout
    from megatron_async_rl.rollout.config import EnvironmentConfig
    from megatron_async_rl.rollout.dataset import PromptDataset

    cfg = make_cfg(tmp_path, steps=2, ahead=0, refill=True, prompts=3, samples=2)
    cfg.rollout.use_chat_template = True
    # every trajectory gets 0.75 from the environment, plus the scripted reward
    cfg.environment = EnvironmentConfig(name="tests.unit.test_agentic:EchoTwice",
                                        reward_fn_weight=1.0)  # fmt: skip
    tokenizer = build_tokenizer()
    side = GenerateSide(
        cfg, FakeEngine(vocab_size=96), tokenizer,
        PromptDataset(cfg.data, tokenizer=tokenizer, use_chat_template=True),
        ScriptedReward(every_third), None, 0, 1, MultiTurnRollout(cfg.environment),
    )  # fmt: skip
    rounds = []
    for step in range(2):
        work = _step(side, step)
        assert [s.prompt_index for s in work.samples] == [0, 0, 1, 1, 2, 2]
        assert informative_groups(work.samples, 2) == {0: True, 1: True, 2: True}
        assert all(0 in s.loss_mask and 1 in s.loss_mask for s in work.samples)
        assert work.report.sums["multiturn/trajectories"] == 6 * work.refill.rounds
        rounds.append(work.refill.rounds)
    assert max(rounds) > 1, "no step needed a refill round: the test checks nothing"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["algorithm.refill=true"],
         "config error: algorithm.refill = True: needs dynamic_filtering: true"),
        (["algorithm.dynamic_filtering=true", "algorithm.refill=true",
          "algorithm.max_refill_rounds=-1"],
         "config error: algorithm.max_refill_rounds = -1: must be an integer >= 1"),
    ],
)  # fmt: skip
def test_a_bad_refill_knob_in_a_recipe_is_one_line_naming_its_key(sets, message, monkeypatch):
    from pathlib import Path

    from megatron_async_rl.recipe.load import resolve

    monkeypatch.chdir(Path(__file__).parent / "bad_inputs")
    with pytest.raises(ConfigError) as info:
        resolve("good.yaml", sets, [])
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    resolve("good.yaml", ["algorithm.dynamic_filtering=true", "algorithm.refill=true"], [])
