"""The per-prompt ledger: which prompts each optimizer step trained on, and with which versions.

Owned here: `PromptLedger`, written by the leader's `LearnSide.log` in both loops, one JSON line
per trained step in `<run_dir>/ledger.jsonl`: `step`, `prompts` (the uids of the step's
prompts, in batch order) and `versions` (the oldest and newest policy version among the step's
response tokens). A resumed run drops the lines of the steps it trains again (`truncate_from`),
as `metrics.jsonl` does, so the file says what the run trained, exactly once per step: a reader
checks that every prompt of an epoch appears once (`read_ledger`), and the staleness bound on
every token (`step - versions[0] <= generate_ahead_steps`) across restarts.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_async_rl.observability.metrics import truncate_jsonl

LEDGER_NAME = "ledger.jsonl"


class PromptLedger:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LEDGER_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, prompts: list[str], versions: tuple[int, int]) -> None:
        record = {"step": step, "prompts": prompts, "versions": list(versions)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def truncate_from(self, step: int) -> int:
        self._file.close()
        dropped = truncate_jsonl(self.path, step)
        self._file = open(self.path, "a", encoding="utf-8")
        return dropped

    def close(self) -> None:
        self._file.close()


def read_ledger(path: str | Path) -> list[dict]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
