"""Prompt datasets (JSONL, Parquet) and the deterministic, checkpointed prompt cursor.

Owned here: `PromptRecord`, `DataCursor` and `PromptDataset`, which the dataloader stage calls
for `next_batch(n)` and the checkpoint code calls for `state_dict()` / `load_state_dict()`; the
recipe's `data:` section is `rollout.config.DatasetConfig`. `encode_prompt` is shared with the
warm start, so both tokenize a prompt the same way. Imports neither torch nor megatron.

A row is a JSON object (one per line) or a Parquet row with a prompt (`prompt`: a string, or
`messages`: a list of {role, content}; `messages` wins when both are present), a ground truth
(`answer`; numbers are turned into strings) and optional `metadata` (an object). Blank JSONL lines
are not rows. A bad row is logged with `file:line` (Parquet: `file:row N`, from 0) and its reason,
then skipped and counted (`data/bad_rows/<reason>`) or, with `on_bad_row: error`, raised as a
`ConfigError`: never dropped silently. Reasons: malformed_json, not_object, missing_prompt,
bad_messages, empty_prompt, missing_answer, bad_metadata, prompt_too_long.

Order: epoch e visits the valid rows in the permutation `numpy.random.default_rng(seed + e)`
(file order without `shuffle`). The cursor (epoch, index) is the whole sampling state, so a run
restored from a saved cursor draws exactly the batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.rollout.config import DatasetConfig

logger = logging.getLogger(__name__)


@dataclass
class PromptRecord:
    """One valid row. Exactly one of `prompt_text` and `messages` is set."""

    uid: str
    """Stable id `file:line` (Parquet `file:row`), the file's base name: survives a move."""
    prompt_ids: list[int] | None
    """Token ids of the prompt when the dataset was given a tokenizer, else None."""
    prompt_text: str | None
    messages: list[dict] | None
    answer: str
    metadata: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)
    """Every field of the row but `metadata` (the reward sees them as `metadata["row"]`)."""

    def reward_metadata(self) -> dict:
        """What the reward gets as `metadata`: the row's `metadata` object, plus `prompt`
        (the prompt text, or the messages) and `row` (the row's fields), unless the row's
        metadata has keys of those names."""
        out = dict(self.metadata)
        out.setdefault(
            "prompt", self.prompt_text if self.prompt_text is not None else self.messages
        )
        out.setdefault("row", dict(self.fields))
        return out


@dataclass
class DataCursor:
    """Position of the next prompt: row `index` of epoch `epoch`'s permutation."""

    epoch: int = 0
    index: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def encode_prompt(
    record: PromptRecord, tokenizer: Any, use_chat_template: bool = False,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of a record's prompt, ending where the response begins.

    `messages` rows (and text rows with `use_chat_template`) go through the tokenizer's chat
    template with the generation prompt; text rows otherwise through `tokenizer.encode` with the
    tokenizer's own special tokens (a BOS where the model expects one). `tools` (JSON schemas)
    go to the chat template, which describes them to the model (multi-turn tool use).
    """
    messages = record.messages
    if messages is None and (use_chat_template or tools):
        messages = [{"role": "user", "content": record.prompt_text}]
    if messages is None:
        return list(tokenizer.encode(record.prompt_text, add_special_tokens=True))
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False,
        **({"tools": tools} if tools else {}),
    )
    if isinstance(ids, Mapping):  # some tokenizer versions return a BatchEncoding regardless
        ids = ids["input_ids"]
    return list(ids)


class _BadRow(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class PromptDataset:
    """The valid rows of one file, in a seeded per-epoch order, drawn through a cursor."""

    MAX_LOGGED_BAD_ROWS = 50

    def __init__(
        self,
        config: DatasetConfig,
        tokenizer: Any = None,
        use_chat_template: bool = False,
        key_prefix: str = "data",
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template
        self.key_prefix = key_prefix
        self.cursor = DataCursor()
        self.bad_rows: Counter[str] = Counter()
        if config.max_prompt_tokens is not None and tokenizer is None:
            logger.warning(
                "%s.max_prompt_tokens = %d is ignored: the dataset was given no tokenizer",
                key_prefix,
                config.max_prompt_tokens,
            )
        self.records = self._load()
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    def __len__(self) -> int:
        return len(self.records)

    def _error(self, rule: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{self.key_prefix}.path", self.config.path, rule, hint)

    def _load(self) -> list[PromptRecord]:
        path = Path(self.config.path)
        if not path.is_file():
            raise self._error("file not found", "check the path (relative to the working dir)")
        jsonl = self.config.resolved_format == "jsonl"
        rows = self._jsonl_rows(path) if jsonl else self._parquet_rows(path)
        records = []
        for location, uid, row in rows:
            try:
                if isinstance(row, _BadRow):
                    raise row
                records.append(self._validate(row, uid))
            except _BadRow as bad:
                self._report(location, bad)
        if self.bad_rows:
            logger.warning(
                "%s: %d bad row(s) skipped: %s",
                path,
                sum(self.bad_rows.values()),
                dict(sorted(self.bad_rows.items())),
            )
        if not records:
            raise self._error(
                f"no valid rows (bad rows: {dict(sorted(self.bad_rows.items())) or 'none'})",
                f"rows need {self.config.prompt_key!r} or {self.config.messages_key!r} "
                f"and {self.config.answer_key!r}",
            )
        return records

    def _jsonl_rows(self, path: Path):
        with path.open("rb") as handle:
            for line_number, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as err:
                    row = _BadRow("malformed_json", f"not UTF-8 text ({err.reason})")
                except json.JSONDecodeError as err:
                    row = _BadRow("malformed_json", f"{err.msg} at column {err.colno}")
                yield f"{path}:{line_number}", f"{path.name}:{line_number}", row

    def _parquet_rows(self, path: Path):
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ConfigError(
                f"{self.key_prefix}.format",
                "parquet",
                "reading Parquet needs pyarrow",
                "pip install pyarrow",
            ) from err
        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for an unreadable file
            raise self._error(f"not a readable Parquet file: {err}") from err
        for index, row in enumerate(table.to_pylist()):
            yield f"{path} row {index}", f"{path.name}:{index}", row

    def _validate(self, row: Any, uid: str) -> PromptRecord:
        config = self.config
        if not isinstance(row, dict):
            raise _BadRow("not_object", f"expected an object, got {type(row).__name__}")
        messages, prompt = row.get(config.messages_key), row.get(config.prompt_key)
        if messages is not None:
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise _BadRow(
                    "bad_messages",
                    f"{config.messages_key!r} must be a non-empty "
                    "list of {role: str, content: str}",
                )
            if not any(m["content"].strip() for m in messages):
                raise _BadRow("empty_prompt", f"every message in {config.messages_key!r} is empty")
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            prompt = None
        elif prompt is None:
            raise _BadRow("missing_prompt", f"no {config.prompt_key!r} or {config.messages_key!r}")
        elif not isinstance(prompt, str):
            raise _BadRow("missing_prompt", f"{config.prompt_key!r} is a {type(prompt).__name__}")
        elif not prompt.strip():
            raise _BadRow("empty_prompt", f"{config.prompt_key!r} is empty")
        answer = row.get(config.answer_key)
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if answer is None and not config.answer_required:
            answer = ""
        elif not isinstance(answer, str) or not answer.strip():
            raise _BadRow("missing_answer", f"{config.answer_key!r} is missing or empty")
        metadata = row.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise _BadRow("bad_metadata", f"'metadata' is a {type(metadata).__name__}")
        record = PromptRecord(uid, None, prompt, messages, answer, metadata or {})
        record.fields = {k: v for k, v in row.items() if k != "metadata"}
        if self.tokenizer is not None:
            record.prompt_ids = encode_prompt(record, self.tokenizer, self.use_chat_template)
            limit = config.max_prompt_tokens
            if limit is not None and len(record.prompt_ids) > limit:
                raise _BadRow(
                    "prompt_too_long",
                    f"{len(record.prompt_ids)} tokens > max_prompt_tokens {limit}",
                )
        return record

    def _report(self, location: str, bad: _BadRow) -> None:
        if self.config.on_bad_row == "error":
            raise self._error(
                f"bad row at {location}: {bad.reason}: {bad}",
                f"fix that row, or set {self.key_prefix}.on_bad_row: skip to skip and count it",
            )
        self.bad_rows[bad.reason] += 1
        if sum(self.bad_rows.values()) <= self.MAX_LOGGED_BAD_ROWS:
            logger.warning("%s: skipping bad row (%s): %s", location, bad.reason, bad)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            n = len(self.records)
            seed = self.config.seed + epoch
            self._order = (
                np.random.default_rng(seed).permutation(n) if self.config.shuffle else np.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    def next_batch(self, n: int) -> list[PromptRecord]:
        """The next `n` records; crosses into the next (re-shuffled) epoch as often as needed."""
        if n < 1:
            raise ValueError(f"next_batch(n={n}): n must be >= 1")
        batch: list[PromptRecord] = []
        while len(batch) < n:
            order = self._epoch_order(self.cursor.epoch)
            start = self.cursor.index
            stop = min(len(order), start + n - len(batch))
            batch.extend(self.records[i] for i in order[start:stop])
            self.cursor.index = stop
            if stop == len(order):
                self.cursor.epoch, self.cursor.index = self.cursor.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The cursor plus what it is only valid for (row count, seed, shuffle)."""
        return {
            "cursor": self.cursor.state_dict(),
            "num_rows": len(self.records),
            "seed": self.config.seed,
            "shuffle": self.config.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the cursor; refuses one saved for other rows, seed or shuffle."""
        saved = (state["num_rows"], state["seed"], state["shuffle"])
        current = (len(self.records), self.config.seed, self.config.shuffle)
        if saved != current:
            raise self._error(
                f"the checkpoint's prompt cursor was saved for (rows, seed, shuffle) = {saved}, "
                f"this dataset has {current}",
                "resume with the same data file, data.seed and data.shuffle",
            )
        cursor = DataCursor()
        cursor.load_state_dict(state["cursor"])
        if cursor.epoch < 0 or not 0 <= cursor.index < len(self.records):
            raise self._error(f"checkpoint cursor {cursor} is out of range")
        self.cursor = cursor

    def metrics(self) -> dict[str, float]:
        """`data/bad_rows/<reason>` per reason seen, `data/num_rows` and `data/epoch`."""
        out = {f"data/bad_rows/{reason}": float(c) for reason, c in sorted(self.bad_rows.items())}
        out["data/num_rows"] = float(len(self.records))
        out["data/epoch"] = float(self.cursor.epoch)
        return out
