"""Requests cut short continue from their prefix: what is kept, what is asked again, the join.

Owned here: the pure rules by which a request whose engine died (or whose run stopped) goes on
from the tokens it had already generated instead of from its prompt. Called by
`engines.recovery.restarting.RestartingEngine` (an engine restarted in place) with the partial
results the dead engine reported (`Engine.partial_results`). No torch, no sglang.

- `kept_prefix`: the part of a partial result that may be kept. Versions only grow along a
  response, so either every token is at least `oldest_version` (the staleness window's lowest
  version for the step being generated) and the whole prefix is kept, or its first token is
  older and nothing is: a later token's context would change once the first ones are generated
  again. Tokens thrown away are counted by the caller as regenerated.
- `settled`: a prefix that is in fact a whole response (cut as its last token came out) is
  marked finished.
- `continuation`: the request that goes on from a kept prefix: the prompt followed by the
  prefix as input, the token budget reduced by the prefix, the same id and seed (an engine
  that seeds by position, e.g. SGLang's deterministic inference, then samples what the
  uninterrupted request would have). None when the prefix already finished the request.
- `joined`: prefix and continuation as one result; every token keeps the log-prob and the
  weight version it was generated with (and the routing, which the continuation's input
  covered).
"""

from __future__ import annotations

import dataclasses

from megatron_async_rl.engines.protocol import GenerateRequest, GenerateResult, version_number

FINISHED = ("stop", "length")


def is_finished(result: GenerateResult) -> bool:
    """Whether `result` is a whole response (it stopped, or used its token budget)."""
    return result.finish_reason in FINISHED


def kept_prefix(
    partial: GenerateResult | None, oldest_version: int | None
) -> tuple[GenerateResult | None, int]:
    """(The part of `partial` to keep or None, the number of its tokens thrown away)."""
    if partial is None or not partial.output_ids:
        return None, 0
    if oldest_version is not None and version_number(partial.token_versions[0]) < oldest_version:
        return None, len(partial.output_ids)
    return partial, 0


def settled(request: GenerateRequest, kept: GenerateResult | None) -> GenerateResult | None:
    """`kept` as the whole response it may already be: a prefix cut ("abort") just as it
    filled the token budget or emitted a stop token is finished ("length", "stop"), and is
    never continued (found by the checkpoint soak: SGLang's abort can overtake the finish of
    a request whose last token is out)."""
    if kept is None or is_finished(kept) or not kept.output_ids:
        return kept
    reason = None
    if kept.output_ids[-1] in request.sampling.stop_token_ids:
        reason = "stop"
    elif len(kept.output_ids) >= request.sampling.max_new_tokens:
        reason = "length"
    return kept if reason is None else dataclasses.replace(kept, finish_reason=reason)


def continuation(request: GenerateRequest, kept: GenerateResult | None) -> GenerateRequest | None:
    """The request that carries `request` on from `kept` (None: nothing left to generate);
    `kept` is `settled` first."""
    if kept is None:
        return request
    if is_finished(kept):
        return None
    left = request.sampling.max_new_tokens - len(kept.output_ids)
    if left < 1:
        raise AssertionError(f"request {request.rid}: a prefix of {len(kept.output_ids)} tokens "
                             f"is not finished but fills max_new_tokens")  # fmt: skip
    sampling = dataclasses.replace(request.sampling, max_new_tokens=left)
    return GenerateRequest(list(request.input_ids) + list(kept.output_ids), sampling, request.rid)


def joined(kept: GenerateResult | None, rest: GenerateResult | None) -> GenerateResult:
    """`kept` followed by `rest` (either may be None, not both)."""
    if kept is None or rest is None:
        result = kept if rest is None else rest
        assert result is not None, "joined(None, None)"
        return result
    return GenerateResult(
        rid=kept.rid,
        output_ids=kept.output_ids + rest.output_ids,
        output_logprobs=kept.output_logprobs + rest.output_logprobs,
        token_versions=kept.token_versions + rest.token_versions,
        finish_reason=rest.finish_reason,
        routed_experts=rest.routed_experts,  # its input held the prefix: every row is there
    )
