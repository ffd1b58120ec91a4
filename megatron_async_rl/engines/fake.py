"""A deterministic in-process `Engine` for unit tests of the code around engines.

`FakeEngine` needs no model, process or sglang: generated token `i` of a request is a pure
function of (prompt, i, weight version) (see `FakeEngine.token`), its log-prob a pure function of
the token, so a test can predict every output. It enforces the protocol's ordering rules the
way SGLang does (`update_weights` only between begin/end; no calls after `shutdown` or after a
simulated death), records every call in `calls` as `(method, kwargs)`, and can simulate what a
real engine does asynchronously: an in-place weight update landing mid-sequence
(`switch_version_at`) and the engine dying (`kill`), also half way through a generate call
(`die_in_generate_after`, with the prefixes reported by `partial_results`). It is not a model
of SGLang's timing.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from megatron_async_rl.engines.protocol import (
    INITIAL_VERSION,
    EngineDiedError,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    WeightSessions,
    check_pause_mode,
)


class FakeEngine:
    """Deterministic `Engine`: token = f(prompt, position, version); records calls."""

    def __init__(self, vocab_size: int = 96, eos_token_id: int | None = None, name: str = "fake"):
        if vocab_size < 2:
            raise ValueError(f"vocab_size = {vocab_size}: must be >= 2")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.name = name
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.paused: str | None = None
        self._version = INITIAL_VERSION
        self._in_update = False
        self.sessions = WeightSessions(name)
        self._switches: list[tuple[int, str]] = []
        self._died: str | None = None
        self._shut_down = False
        self._die_at: dict[str, str] = {}
        self._die_after_tokens: tuple[int, str] | None = None
        self._partial: dict[str, GenerateResult] = {}
        self._hung = False
        self._unhang = threading.Event()

    # -- what a test can predict -------------------------------------------------------------

    def token(self, input_ids: Sequence[int], position: int, version: str) -> int:
        """The token this engine generates at `position` after `input_ids` under `version`."""
        seed = zlib.crc32(f"{list(input_ids)}|{position}|{version}".encode())
        return seed % self.vocab_size

    @staticmethod
    def logprob(token: int) -> float:
        """The log-prob this engine reports for `token`."""
        return -0.1 * (1 + token % 7)

    # -- test controls -----------------------------------------------------------------------

    def switch_version_at(self, position: int, version: str) -> None:
        """In the next `generate`, tokens from `position` on use `version` (an in-place update)."""
        self._switches.append((position, version))

    def kill(self, cause: str = "killed by the test") -> None:
        """Simulate the engine dying: every later call raises `EngineDiedError` (and a
        `generate` held by `hang` returns with it)."""
        self._died = cause
        self._unhang.set()

    def die_in_generate_after(self, num_tokens: int, cause: str = "died mid-generation") -> None:
        """The next `generate` dies once each request has `num_tokens` tokens (those that
        finish sooner are whole); `partial_results` then reports what it had generated."""
        self._die_after_tokens = (num_tokens, cause)

    def die_at(self, method: str, cause: str = "died in the call") -> None:
        """The next call of `method` finds the engine dead (it dies as the call starts)."""
        self._die_at[method] = cause

    def hang(self) -> None:
        """Simulate a hung engine (SIGSTOP): every call blocks until `kill`, `probe` fails."""
        self._unhang.clear()
        self._hung = True

    def signal_scheduler(self, sig: int) -> None:
        """What `SGLangEngine.signal_scheduler` does: SIGSTOP hangs, anything else kills."""
        import signal

        if sig == signal.SIGSTOP:
            self.hang()
        else:
            self.kill(f"scheduler got signal {sig}")

    def probe(self, timeout_s: float, control_only: bool = False) -> str | None:
        """None while the engine would answer a one-token request (see `SGLangEngine.probe`)."""
        self.calls.append(("probe", {"control_only": control_only}))
        if self._died is not None or self._hung:
            return self._died or f"no answer to a one-token request within {timeout_s:g} s"
        return None

    # -- Engine protocol ---------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        self._enter("generate", rids=[r.rid for r in requests])
        self.sessions.check_whole()
        results = [self._generate_one(r) for r in requests]
        if self._die_after_tokens is not None:
            num_tokens, cause = self._die_after_tokens
            self._die_after_tokens = None
            self._partial = {r.rid: _cut(r, num_tokens) for r in results}
            self.kill(cause)
            raise EngineDiedError(f"{self.name} died: {cause}; during generate")
        if self._switches:
            self._version = self._switches[-1][1]
            self._switches.clear()
        return results

    def _generate_one(self, request: GenerateRequest) -> GenerateResult:
        stop_ids = set(request.sampling.stop_token_ids)
        if self.eos_token_id is not None and not request.sampling.ignore_eos:
            stop_ids.add(self.eos_token_id)
        output_ids, versions = [], []
        finish_reason = "length"
        version = self._version
        for position in range(request.sampling.max_new_tokens):
            for at, switched in self._switches:
                if position == at:
                    version = switched
            token = self.token(request.input_ids, position, version)
            output_ids.append(token)
            versions.append(version)
            if token in stop_ids:
                finish_reason = "stop"
                break
        return GenerateResult(
            rid=request.rid,
            output_ids=output_ids,
            output_logprobs=[self.logprob(t) for t in output_ids],
            token_versions=versions,
            finish_reason=finish_reason,
        )

    def partial_results(self, rids: Sequence[str]) -> dict[str, GenerateResult]:
        """What a generate call that died had produced for `rids` (see
        `die_in_generate_after`)."""
        return {rid: self._partial[rid] for rid in rids if rid in self._partial}

    def begin_weight_update(self) -> None:
        self._enter("begin_weight_update")
        if self._in_update:
            raise RuntimeError(f"{self.name}: a weight-update session is already open")
        self._in_update = True
        self.sessions.begin()

    def update_weights(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        version: str | int,
        flush_cache: bool = True,
    ) -> None:
        self._enter(
            "update_weights",
            names=[n for n, _ in named_tensors],
            version=str(version),
            flush_cache=flush_cache,
        )
        if not self._in_update:
            raise RuntimeError(
                f"{self.name}: update_weights must run between begin_weight_update() and "
                "end_weight_update()"
            )
        for name, tensor in named_tensors:
            self.weights[name] = tensor.detach().clone()
        self._version = str(version)
        self.sessions.loaded()

    def end_weight_update(self, complete: bool = True) -> None:
        self._enter("end_weight_update")
        if not self._in_update:
            raise RuntimeError(f"{self.name}: no weight-update session is open")
        self._in_update = False
        self.sessions.end(complete)

    def weight_version(self) -> str:
        self._enter("weight_version")
        return self._version

    def pause(self, mode: PauseMode) -> None:
        check_pause_mode(mode)
        self._enter("pause", mode=mode)
        self.paused = mode

    def resume(self) -> None:
        self._enter("resume")
        self.paused = None

    def abort(self, rid: str | None = None) -> None:
        self._enter("abort", rid=rid)

    def flush_cache(self) -> None:
        self._enter("flush_cache")

    def health(self) -> bool:
        self.calls.append(("health", {}))
        return self._died is None and not self._shut_down

    def shutdown(self) -> None:
        self.calls.append(("shutdown", {}))
        self._shut_down = True

    def get_weights_by_name(self, name: str) -> torch.Tensor:
        self._enter("get_weights_by_name", name=name)
        if name not in self.weights:
            raise KeyError(f"{self.name}: no weight {name!r} was ever sent")
        return self.weights[name].clone()

    def _enter(self, method: str, **kwargs: Any) -> None:
        self.calls.append((method, kwargs))
        if self._hung:  # every call blocks until the engine is killed
            self._unhang.wait()
        if method in self._die_at:
            self._died = self._die_at.pop(method)
        if self._died is not None:
            raise EngineDiedError(f"{self.name} died: {self._died}; cannot call {method}")
        if self._shut_down:
            raise RuntimeError(f"{self.name} was shut down; cannot call {method}")

    def methods_called(self) -> list[str]:
        """The method names in `calls`, in order (for ordering assertions)."""
        return [method for method, _ in self.calls]


def _cut(result: GenerateResult, num_tokens: int) -> GenerateResult:
    """`result` as it stood after `num_tokens` tokens ("abort": cut short)."""
    if len(result.output_ids) <= num_tokens:
        return result
    return GenerateResult(
        rid=result.rid,
        output_ids=result.output_ids[:num_tokens],
        output_logprobs=result.output_logprobs[:num_tokens],
        token_versions=result.token_versions[:num_tokens],
        finish_reason="abort",
    )
