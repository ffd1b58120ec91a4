"""Prompts to samples: the generate stage of one step, on the `generate` ranks.

Owned here: the `Sample` record every later stage reads, which prompts a generate rank serves,
and the call into its engine, configured by the recipe's `rollout:` section
(`rollout.config.RolloutConfig`). Called by the jobs once per step. Each prompt is sampled `n`
times (one GRPO group); every request carries its own seed derived from (run seed, step, prompt
uid, sample index), so a run replays exactly.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_async_rl.rollout.config import RolloutConfig


@dataclass
class Sample:
    """One response to one prompt, with what the engine reported about each token."""

    uid: str
    prompt_index: int  # position of the prompt in the step's batch
    sample_index: int  # index inside its GRPO group
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # behaviour log-probs from the engine
    token_versions: list[str]  # engine weight version that produced each response token
    finish_reason: str
    answer: str
    metadata: dict = field(default_factory=dict)
    response_text: str = ""
    reward: float = 0.0
    loss_mask: list[int] | None = None
    """Per response token, 1 where it is trained: None = every token (single-turn); a
    multi-turn trajectory has 0 on its environment's tokens (`rollout.agentic`)."""
    routed_experts: Any = None
    """MoE: the engine's experts per input token, a uint8/int16 tensor [P + R - 1, MoE layers,
    top-k] (`moe.routing`), when the run asks for them; else None."""

    def trained_versions(self) -> list[str]:
        """The versions of the tokens trained (the staleness bound holds on these)."""
        if self.loss_mask is None:
            return list(self.token_versions)
        return [v for v, m in zip(self.token_versions, self.loss_mask, strict=True) if m]

    def to_dict(self) -> dict:
        """The fields by name, for pickling (the step's exchange, a checkpoint): shallow, the
        lists shared with this sample (`dataclasses.asdict` copies each deeply: 11 ms a step
        of 128 short samples, on the learn side's critical path)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def served_prompts(num_prompts: int, rank_in_role: int, num_generate_ranks: int) -> list[int]:
    """The prompt indices a generate rank serves (round robin)."""
    return list(range(rank_in_role, num_prompts, num_generate_ranks))


def request_seed(run_seed: int, step: int, uid: str, sample_index: int) -> int:
    text = f"{run_seed}:{step}:{uid}:{sample_index}".encode()
    return zlib.crc32(text) & 0x7FFFFFFF


def request_id(step: int, prompt_index: int, sample_index: int) -> str:
    """The engine request id of one sample of a step."""
    return f"s{step}-p{prompt_index}-k{sample_index}"


def generate_samples(
    engine,
    tokenizer,
    records,
    prompt_ids: dict[int, list[int]],
    indices: list[int],
    num_samples: int,
    cfg: RolloutConfig,
    *,
    step: int,
    run_seed: int,
    prefixes: Mapping | None = None,
) -> list[Sample]:
    """Sample `num_samples` responses for each prompt in `indices` with `engine`. `prefixes`
    (request id -> `GenerateResult`): responses generated earlier and cut short, continued
    from there (`engines.recovery.prefixes`); a whole one is taken as it is."""
    from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
    from megatron_async_rl.engines.recovery import prefixes as continuing

    prefixes = prefixes or {}
    stops_at_eos = tokenizer.eos_token_id is not None and not cfg.ignore_eos
    stop = (tokenizer.eos_token_id,) if stops_at_eos else ()
    requests, owners = [], []
    for index in indices:
        record = records[index]
        for k in range(num_samples):
            sampling = SamplingParams(
                max_new_tokens=cfg.max_new_tokens,
                temperature=float(cfg.temperature),
                top_p=float(cfg.top_p),
                top_k=cfg.top_k,
                seed=request_seed(run_seed, step, record.uid, k),
                stop_token_ids=stop,
                ignore_eos=cfg.ignore_eos,
            )
            rid = request_id(step, index, k)
            requests.append(GenerateRequest(prompt_ids[index], sampling, rid))
            owners.append((index, k))
    prefixes = {r.rid: continuing.settled(r, prefixes.get(r.rid)) for r in requests}
    todo = [continuing.continuation(r, prefixes[r.rid]) for r in requests]
    todo = [r for r in todo if r is not None]
    rest = {r.rid: r for r in engine.generate(todo)} if todo else {}
    results = [continuing.settled(r, continuing.joined(prefixes[r.rid], rest.get(r.rid)))
               for r in requests]  # fmt: skip
    samples = []
    for (index, k), result in zip(owners, results, strict=True):
        record = records[index]
        samples.append(
            Sample(
                uid=record.uid,
                prompt_index=index,
                sample_index=k,
                prompt_ids=list(prompt_ids[index]),
                response_ids=list(result.output_ids),
                response_logprobs=list(result.output_logprobs),
                token_versions=list(result.token_versions),
                finish_reason=result.finish_reason,
                answer=record.answer,
                metadata=record.reward_metadata(),
                response_text=tokenizer.decode(result.output_ids, skip_special_tokens=True),
                routed_experts=result.routed_experts,
            )
        )
    return samples


def as_result(sample: Sample, step: int):
    """A sample's response as the engine's `GenerateResult` (to continue it)."""
    from megatron_async_rl.engines.protocol import GenerateResult

    return GenerateResult(
        rid=request_id(step, sample.prompt_index, sample.sample_index),
        output_ids=list(sample.response_ids),
        output_logprobs=list(sample.response_logprobs),
        token_versions=list(sample.token_versions),
        finish_reason=sample.finish_reason,
    )
