"""`rollout.ignore_eos`: every response is `max_new_tokens` long (for benchmarks that need equal
lengths on both sides). The rollout path with the fake engine; the real engine's twin is
`tests/distributed/test_sglang_engine.py::test_ignore_eos_on_the_real_engine`."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_async_rl.engines.fake import FakeEngine
from megatron_async_rl.engines.protocol import INITIAL_VERSION
from megatron_async_rl.rollout.config import RolloutConfig
from megatron_async_rl.rollout.dataset import PromptRecord
from megatron_async_rl.rollout.generation import generate_samples


def _samples(engine, ignore_eos: bool):
    records = [PromptRecord(f"f:{i}", [1, 2 + i], "x", None, "0") for i in range(4)]
    tokenizer = SimpleNamespace(eos_token_id=engine.eos_token_id, decode=lambda ids, **_: "")
    cfg = RolloutConfig(max_new_tokens=12, ignore_eos=ignore_eos)
    return generate_samples(engine, tokenizer, records, {i: r.prompt_ids for i, r in
                                                          enumerate(records)},
                            list(range(4)), 4, cfg, step=0, run_seed=1)  # fmt: skip


def test_ignore_eos_makes_every_response_full_length():
    probe = FakeEngine()
    # an EOS the fake emits early in some responses: the most common token at position 1
    firsts = [probe.token([1, 2 + i], 1, INITIAL_VERSION) for i in range(4)]
    engine = FakeEngine(eos_token_id=max(set(firsts), key=firsts.count))
    natural = _samples(engine, ignore_eos=False)
    assert any(s.finish_reason == "stop" and len(s.response_ids) < 12 for s in natural)
    forced = _samples(engine, ignore_eos=True)
    assert all(len(s.response_ids) == 12 and s.finish_reason == "length" for s in forced)
    assert any(engine.eos_token_id in s.response_ids[:-1] for s in forced)
