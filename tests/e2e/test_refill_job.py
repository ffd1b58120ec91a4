"""Dynamic sampling with refill through the real entry point, in the asynchronous loop.

Contracts checked, on 3 steps of the tiny recipe (16 prompts x 8 samples per step) with
`algorithm.refill` and a reward under which only prompts with an even answer can be informative
(`even_answers_only`: a response's first character decides its reward, so with 8 sampled
responses such a group almost always has rewards that differ; any other group scores 0.0):
- every training batch holds exactly 16 informative groups: the generate side's counts
  (`dynamic_sampling/groups_kept` 16, nothing padded) and, independently, the learn side's
  (`data/zero_variance_groups` 0, all 128 samples trained) and the prompt ledger (16 distinct
  prompts a step, each with an even answer in the data file); refill rounds did run;
- the run has the non-default loss side on (GSPO, RLOO advantages, tis_seq
  weights, a geometric-mean rejection band, DAPO's overlong penalty and truncation filter, 2
  mini-batches per step), and its knobs act: the penalty is paid, their metrics are logged, the
  truncation filter and the rejection band mask samples the refill kept.
Nothing is faked: real torchrun, megatron-core, gloo and SGLang on CPU; the reward is a
`module:function` reward as a user writes one. That the asynchronous loop at
`generate_ahead_steps: 0` with refill is the synchronous loop exactly (metrics and prompts at
every step) is shown in one process with the fake engine (tests/unit/test_refill_pipeline.py);
without refill, end to end, by tests/cluster/test_multihost.py and tests/e2e/test_ppo_job.py.
"""

import importlib.util
import json

import pytest

from megatron_async_rl.observability.ledger import read_ledger
from tests.harness.recipes import run_recipe

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed"),
]
PROMPTS, SAMPLES, STEPS = 16, 8, 3


def even_answers_only(response_text: str, answer: str, metadata: dict) -> float:
    """1.0 when the answer is even and the response's first character has an odd code."""
    if int(answer) % 2 or not response_text:
        return 0.0
    return float(ord(response_text[0]) % 2)


REFILL_SETS = (
    f"trainer.num_steps={STEPS}",
    "algorithm.dynamic_filtering=true",
    "algorithm.refill=true",
    "reward.name=tests.e2e.test_refill_job:even_answers_only",
)
LOSS_SIDE_SETS = (
    "megatron.global_batch_size=64",
    "algorithm.policy_loss=gspo",
    "algorithm.loss_agg_mode=null",  # the recipe's token-mean: GSPO takes its own
    "algorithm.advantage_estimator=rloo",
    "algorithm.off_policy_correction=tis_seq",
    "algorithm.off_policy_mask=geo_mean",
    "algorithm.off_policy_mask_low=0.99",
    "algorithm.off_policy_mask_high=1.01",
    "algorithm.overlong_buffer_len=2",
    "algorithm.overlong_penalty_factor=0.5",
    "algorithm.mask_truncated=true",
)


def test_refill_batches_hold_exactly_the_informative_groups(task, tmp_path):
    run = run_recipe(task, tmp_path / "async", *REFILL_SETS, *LOSS_SIDE_SETS,
                     "scheduler.loop=async")  # fmt: skip
    answers = {}
    for line_number, line in enumerate(task.data.read_text().splitlines(), start=1):
        try:
            answers[f"{task.data.name}:{line_number}"] = int(json.loads(line)["answer"])
        except (ValueError, KeyError):  # the fixture's bad rows, which the dataset skips
            continue
    assert len(run.rows) == STEPS
    for row in run.rows:
        assert row["dynamic_sampling/groups_kept"] == PROMPTS
        assert row["dynamic_sampling/groups_padded"] == 0
        assert row["data/zero_variance_groups"] == 0.0 and row["data/dropped_groups"] == 0
        # the truncation filter, then the rejection band, mask some of them (the loss side)
        untruncated = PROMPTS * SAMPLES - row["samples/masked_truncated"]
        rejected = round(row["offpolicy/masked_seq_frac"] * untruncated)
        assert row["samples/kept"] == untruncated - rejected
    assert max(r["dynamic_sampling/rounds"] for r in run.rows) > 1, "no refill round ran"
    ledger = read_ledger(run.run_dir / "ledger.jsonl")
    assert len(ledger) == STEPS
    for entry in ledger:
        assert len(set(entry["prompts"])) == PROMPTS
        assert all(answers[uid] % 2 == 0 for uid in entry["prompts"])
