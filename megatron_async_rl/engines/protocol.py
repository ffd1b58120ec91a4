"""The generation-engine contract that `generate` ranks program against.

Owned here: the request and result records, the `Engine` protocol (generate with token ids;
begin/update/end weight update stamped with a version; pause/resume; abort; flush cache;
health; shutdown), the errors an engine raises at run time, and the expansion of SGLang-style
version spans into one weight version per generated token. Implemented by
`sglang.engine.SGLangEngine` (the real engine) and `fake.FakeEngine` (unit tests). Two more
protocols name what engine recovery (`engines.recovery.restarting`) adds: `RestartableEngine`,
what it needs of the engine it wraps (probe, kill), and `ManagedEngine`, what the restarting
engine offers its users beyond `Engine` (step, resume point, metrics, the last complete version);
`EngineLimits`, the request sizes an engine refuses, where it knows them.
Imports neither torch.distributed nor sglang.

Weight versions are strings: an engine reports the label of the weights that produced each
token, `Engine.INITIAL_VERSION` ("default", SGLang's own default) before the first update.

Lifecycle of a weight update, the ordering every implementation accepts:

    pause(mode)?  ->  begin_weight_update()  ->  update_weights(...) x N  ->  end_weight_update()
                  ->  resume()  (if paused)

`update_weights` outside a begin/end pair raises `RuntimeError`. A caller that gives up half-way
ends with `end_weight_update(complete=False)`: the engine then never generates from the mixed
weights (`WeightSessions`, `EngineTornError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Literal, Protocol, runtime_checkable

import torch

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")


def check_pause_mode(mode: str) -> None:
    """Raise ValueError unless `mode` is one of PAUSE_MODES (every engine's `pause` calls it)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode = {mode!r}: must be one of {PAUSE_MODES}")


INITIAL_VERSION = "default"


def version_number(label: str) -> int:
    """Policy version of an engine weight-version label: 'default' (initial) = 0, 'v3' = 3."""
    if label in (INITIAL_VERSION, "", None):
        return 0
    return int(str(label).lstrip("v"))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuation."""

    max_new_tokens: int = 128
    """Upper bound on generated tokens (the engine may stop earlier at a stop token)."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""
    seed: int | None = None
    """Per-request sampling seed; None lets the engine choose."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting any of these (the model's EOS is always one)."""
    ignore_eos: bool = False
    """Never stop at the model's EOS: every response is `max_new_tokens` long (give no
    `stop_token_ids` with it)."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k = {self.top_k}: must be -1 (all) or >= 1")
        if self.ignore_eos and self.stop_token_ids:
            raise ValueError(f"ignore_eos with stop_token_ids = {self.stop_token_ids}: a "
                             "response that ignores EOS has no stop tokens")


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One prompt, already tokenized, and how to continue it."""

    input_ids: list[int]
    """Prompt token ids (no padding)."""
    sampling: SamplingParams
    """Sampling parameters for this request."""
    rid: str
    """Request id, unique among the engine's in-flight requests; `abort(rid)` names it."""

    def __post_init__(self):
        if not self.input_ids:
            raise ValueError(f"request {self.rid!r}: input_ids is empty; a prompt needs a token")


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What the engine generated for one request."""

    rid: str
    """The request's id."""
    output_ids: list[int]
    """Generated token ids (the prompt excluded)."""
    output_logprobs: list[float]
    """Log-probability of each generated token under the weights that generated it."""
    token_versions: list[str]
    """Weight version that generated each token; changes mid-sequence across an in-place update."""
    finish_reason: str
    """"length", "stop" (a stop or EOS token), or "abort" (aborted or paused with mode=abort)."""
    routed_experts: object = None
    """MoE routing replay: the experts each input token went through, a uint8/int16 tensor
    [len(input_ids) + len(output_ids) - 1, MoE layers, top-k] (`moe.routing`), when the
    engine was asked for them; else None."""

    def __post_init__(self):
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.token_versions) != n:
            raise ValueError(
                f"result {self.rid!r}: {n} output ids but {len(self.output_logprobs)} log-probs "
                f"and {len(self.token_versions)} versions; all three must match"
            )


class EngineDiedError(RuntimeError):
    """The engine (or one of its processes) exited; the engine cannot serve any more calls."""


class EngineTimeoutError(TimeoutError):
    """An engine call did not answer within its timeout; names the call and the limit."""


class EngineTornError(RuntimeError):
    """The engine's weights are partly of a new version (an update was abandoned half-way):
    it refuses to generate until a weight update completes."""


class WeightSessions:
    """What an engine knows of its weight-update sessions: whether its weights are whole.

    Every engine holds one. A session ended incomplete (`end(complete=False)`) after at least
    one load leaves the weights torn: `check_whole` raises `EngineTornError` (from `generate`)
    until a later session ends complete. Ended incomplete before any load, nothing changed.
    """

    def __init__(self, where: str):
        self.where, self.loads = where, 0
        self.torn: str | None = None

    def begin(self) -> None:
        self.loads = 0

    def loaded(self) -> None:
        self.loads += 1

    def end(self, complete: bool) -> None:
        if complete:
            self.torn = None
        elif self.loads:
            self.torn = (
                f"[{self.where}] a weight update was abandoned after {self.loads} load call(s): "
                "part of the weights are new, part old; the engine refuses to generate until "
                "a weight update completes"
            )

    def check_whole(self) -> None:
        if self.torn:
            raise EngineTornError(self.torn)


@runtime_checkable
class Engine(Protocol):
    """A generation engine with versioned in-place weight updates."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Generate for every request; results in request order. Blocks until all finish.
        Raises `EngineTornError` while the weights are torn (see `end_weight_update`)."""
        ...

    def partial_results(self, rids: Sequence[str]) -> dict[str, GenerateResult]:
        """After a `generate` call failed (the engine died): what it had generated for those
        of `rids` it had reported, each a prefix ("abort") or a whole response ("stop",
        "length"). Read by `engines.recovery.restarting` to carry the requests on from there."""
        ...

    def begin_weight_update(self) -> None:
        """Open a weight-update session."""
        ...

    def update_weights(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        version: str | int,
        flush_cache: bool = True,
    ) -> None:
        """Load `named_tensors` (HF names) and stamp `version` on tokens generated from now on."""
        ...

    def end_weight_update(self, complete: bool = True) -> None:
        """Close the weight-update session. `complete=False`: the caller abandons it; if
        anything was loaded, `generate` raises `EngineTornError` until a session completes."""
        ...

    def weight_version(self) -> str:
        """The version of the weights being served."""
        ...

    def pause(self, mode: PauseMode) -> None:
        """Stop decoding: abort in-flight requests, retract them (recompute later), or hold them."""
        ...

    def resume(self) -> None:
        """Continue decoding after `pause`."""
        ...

    def abort(self, rid: str | None = None) -> None:
        """Abort one request, or all in-flight requests when `rid` is None."""
        ...

    def flush_cache(self) -> None:
        """Drop the prefix (KV) cache; the engine must be idle."""
        ...

    def health(self) -> bool:
        """True while the engine and all its processes are alive and answering."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and its processes; idempotent."""
        ...

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        """A served parameter by HF name, as float32 on CPU (for checks, not for speed)."""
        ...


@runtime_checkable
class RestartableEngine(Engine, Protocol):
    """What `engines.recovery.restarting.RestartingEngine` needs of the engine it wraps, beyond
    `Engine` (whose `partial_results` it reads after a failed `generate`): a health probe
    that finds a hung engine, and a kill that works on one. Implemented by
    `sglang.engine.SGLangEngine` and `fake.FakeEngine`."""

    def probe(self, timeout_s: float, control_only: bool = False) -> str | None:
        """None while the engine answers a one-token request within `timeout_s` (with
        `control_only`, for a paused engine or one loading weights: a round trip to its
        schedulers); else what went wrong."""
        ...

    def kill(self, cause: str) -> None:
        """Kill the engine's processes at once; calls waiting on it raise `EngineDiedError`
        naming `cause`."""
        ...


@runtime_checkable
class EngineLimits(Protocol):
    """The request sizes an engine refuses, where it knows them (`SGLangEngine`, read from the
    served model): the multi-turn rollout ends a trajectory before it reaches them."""

    context_tokens: int | None
    """A request whose input plus `max_new_tokens` is longer is refused."""
    max_input_tokens: int | None
    """A request whose input has this many tokens or more is refused."""


@runtime_checkable
class ManagedEngine(Protocol):
    """What `engines.recovery.restarting.RestartingEngine` offers beyond the `Engine` calls it
    carries on (it has no `partial_results` of its own: a failed call is carried on inside it). The
    generate side, the asynchronous loop, the multi-turn rollout and the weight sink check for
    it with `isinstance`; a bare engine, as in most unit tests, has none of it."""

    inner: RestartableEngine
    """The engine serving now (replaced by each restart)."""
    keeps_weights: bool
    """True when it keeps a host copy of the newest complete version (restarts allowed):
    `restore_last_version` can then undo a torn load."""
    board: object | None
    """With several engines, the `engines.recovery.reassign.HelpBoard` their dead engines'
    requests go through; else None."""
    help_gate: Callable[[], AbstractContextManager]
    """Entered around a job taken over from another engine (the asynchronous loop sets it to
    its engine gate's `generating(stage=False)`)."""

    def set_step(self, step: int, oldest_version: int | None = None) -> None:
        """The step being generated (the restart budget counts steps) and the oldest policy
        version its tokens may carry (an older prefix of a cut request is generated again)."""
        ...

    def resumed_at(self, step: int) -> None:
        """The run resumed at `step`: the restart window and injected faults count from it."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """`engines/*` counters since the last call, and whether the engine is healthy now."""
        ...

    def restore_last_version(self) -> None:
        """Serve the newest complete version again (a version failed on every attempt)."""
        ...


def expand_version_spans(spans: Sequence[dict], num_tokens: int) -> list[str]:
    """Per-token versions from spans `[{'version', 'start', 'end'}, ...]` covering `num_tokens`.

    The spans must be sorted, contiguous from 0 and cover every token; anything else raises
    `ValueError` naming the spans (a gap would leave a token without a version).
    """
    versions: list[str] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise ValueError(
                f"weight version spans {list(spans)} are not contiguous from token 0 "
                f"(span starting at {start} after {len(versions)} tokens)"
            )
        versions.extend([str(span["version"])] * (end - start))
    if len(versions) != num_tokens:
        raise ValueError(
            f"weight version spans {list(spans)} cover {len(versions)} tokens, "
            f"expected {num_tokens}"
        )
    return versions
