"""Generation progress reported while it runs, so that an engine's death loses few tokens.

Owned here: both ends of the "progress" message of the engine host's pipe.

- `ProgressReporter` (in the engine host, `engines.sglang.host`): SGLang streams each request
  of a generate call every `engine.progress_every_tokens` tokens; the reporter keeps the newest
  streamed output of each request and, at most every `progress_every_s` and once more when an
  engine process dies, sends what changed to the rank: per request id, the token ids so far,
  their log-probs, their weight versions and the finish reason (None while it runs).
- `PartialResults` (in the rank, `engines.sglang.engine`): the newest report of each request of
  the calls in progress, as `GenerateResult`s ("abort" while unfinished), for
  `Engine.partial_results` after the call failed; forgotten once a call returns.

Pure: no torch, no sglang (SGLang's streamed outputs are plain dicts: `output_ids`, and in
`meta_info` `output_token_logprobs`, `weight_versions` spans and `finish_reason`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from megatron_async_rl.engines.protocol import GenerateResult

Report = tuple[list[int], list[float], list[str], str | None]
"""One request's progress: token ids, log-probs, weight versions, finish reason or None."""


def snapshot(out: dict) -> Report:
    """A streamed SGLang output as a `Report`, cut to the tokens every field covers (its lists
    may be SGLang's own, still growing)."""
    meta = out["meta_info"]
    ids, logprobs = list(out["output_ids"]), [float(lp) for lp, *_ in meta["output_token_logprobs"]]
    spans = meta.get("weight_versions") or [
        {"version": meta["weight_version"], "start": 0, "end": len(ids)}
    ]
    versions: list[str] = []
    for span in spans:
        versions.extend([str(span["version"])] * (int(span["end"]) - int(span["start"])))
    n = min(len(ids), len(logprobs), len(versions))
    finish = meta.get("finish_reason")
    reason = str(finish["type"]) if finish else None
    if reason is not None and n < len(ids):
        reason = None  # the finished output is not whole yet: report it as a prefix
    return ids[:n], logprobs[:n], versions[:n], reason


class ProgressReporter:
    """Host side: the newest output of every live request; `flush` sends what changed."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send
        self._latest: dict[str, dict] = {}
        self._changed: set[str] = set()

    def record(self, rid: str, out: dict) -> None:
        self._latest[rid] = out
        self._changed.add(rid)

    def forget(self, rids: Iterable[str]) -> None:
        """The call of `rids` returned: its results travel in the reply."""
        for rid in rids:
            self._latest.pop(rid, None)
            self._changed.discard(rid)

    def flush(self) -> None:
        if not self._changed:
            return
        payload = {rid: snapshot(self._latest[rid]) for rid in sorted(self._changed)}
        self._changed.clear()
        self._send(("progress", payload))


class PartialResults:
    """Rank side: the newest report of each request of the generate calls in progress."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reports: dict[str, Report] = {}

    def update(self, payload: dict[str, Report]) -> None:
        with self._lock:
            self._reports.update(payload)

    def forget(self, rids: Iterable[str]) -> None:
        with self._lock:
            for rid in rids:
                self._reports.pop(rid, None)

    def take(self, rids: Iterable[str]) -> dict[str, GenerateResult]:
        """The reports of `rids` (those with any), forgotten here."""
        out = {}
        with self._lock:
            for rid in rids:
                report = self._reports.pop(rid, None)
                if report is not None:
                    ids, logprobs, versions, reason = report
                    out[rid] = GenerateResult(rid, ids, logprobs, versions, reason or "abort")
        return out
