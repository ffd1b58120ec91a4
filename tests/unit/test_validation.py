"""Validation (`rollout/validation.py`): its recipe section and one pass on an engine.

Contracts checked: bad `validation:` knobs are errors naming the field, value and rule; the
sampling of a pass is the training one with validation's knobs on top (greedy by default);
a pass scores this rank's share of the held-out rows with its own reward counters, uses request
seeds no training step uses, and reports `val/` metrics for the version it was given. The
engine is the deterministic fake (`engines/fake.py`, itself tested against SGLang's protocol);
the real engine runs validation in the shared synchronous run (`sync_run`, tests/conftest.py)
and its asynchronous twin on two hosts (`tests/cluster/test_multihost.py`).
"""

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.rollout.generation import RolloutConfig
from megatron_async_rl.rollout.validation import SEED_STEP_OFFSET, ValidationConfig, Validator


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"num_prompts": 0}, "num_prompts"),
        ({"num_samples_per_prompt": 0}, "num_samples_per_prompt"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
    ],
)
def test_bad_knobs_name_the_field(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        ValidationConfig(**kwargs)


def test_sampling_is_greedy_by_default_and_keeps_the_training_length():
    rollout = RolloutConfig(max_new_tokens=7, temperature=1.0, top_p=0.9, top_k=5)
    sampling = ValidationConfig().rollout_config(rollout)
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.0, 1.0, -1)
    assert sampling.max_new_tokens == 7
    assert ValidationConfig(max_new_tokens=3).rollout_config(rollout).max_new_tokens == 3


def _Record(uid, answer):  # a real row, its prompt already tokenised
    from megatron_async_rl.rollout.dataset import PromptRecord

    return PromptRecord(uid, [1, 2, 3], "1+0=", None, answer)


class _Tokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Reward:
    def __init__(self):
        self.errors = 0

    def score(self, samples):
        return [1.0 if s.sample_index == 0 else 0.0 for s in samples]


def test_a_pass_scores_this_ranks_share_with_its_own_seeds():
    records = [_Record(f"u{i}", "1") for i in range(5)]
    validator = Validator(
        ValidationConfig(num_samples_per_prompt=2), RolloutConfig(max_new_tokens=2), records,
        _Reward(), rank_in_role=1, num_generate_ranks=2, run_seed=3,
    )  # fmt: skip
    engine = FakeEngine()
    metrics = validator.run(engine, _Tokenizer(), version=4, encode=lambda r: r.prompt_ids)
    rids = [rid for name, call in engine.calls if name == "generate" for rid in call["rids"]]
    assert len(rids) == 4  # rows 1 and 3, two samples each
    assert metrics["val/version"] == 4.0
    assert metrics["val/num_samples"] == 4.0
    assert metrics["val/reward_mean"] == 0.5 and metrics["val/accuracy"] == 0.5
    assert metrics["val/response_len_mean"] == 2.0
    assert all(rid.startswith(f"s{SEED_STEP_OFFSET + 4}-") for rid in rids)
