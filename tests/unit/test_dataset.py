"""Contract of `rollout/dataset.py`: prompt files in, valid records and a resumable order out.

- Every bad JSONL row (malformed JSON, not an object, missing prompt or answer, empty prompt,
  bad messages or metadata, a prompt over `max_prompt_tokens`) is logged with `file:line` and
  its reason and counted in `data/bad_rows/<reason>`; with `on_bad_row: error` the first one is
  a `ConfigError` naming the file, line and reason. No valid rows is an error too.
- Parquet files written with pyarrow give the same records as the JSONL equivalent.
- Order: each epoch is a seeded permutation of the valid rows; `next_batch` crosses epochs; a
  dataset restored from `state_dict()` continues exactly as an uninterrupted one, and refuses a
  state saved for other rows or another seed.
- Tokenization uses the real tiny character tokenizer (`models/tiny.py`); nothing is faked.
"""

from __future__ import annotations

import json
import logging

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.models.tiny import build_tokenizer
from megatron_async_rl.rollout.dataset import (
    DatasetConfig,
    PromptDataset,
    PromptRecord,
    encode_prompt,
)


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _good_rows(n):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(n)]


BAD_ROWS = [
    '{"prompt": "1+1=", "answer": "2"',  # line 1: malformed_json
    "[1, 2]",  # line 2: not_object
    {"answer": "3"},  # line 3: missing_prompt
    {"prompt": "2+2="},  # line 4: missing_answer
    {"prompt": "   ", "answer": "1"},  # line 5: empty_prompt
    {"prompt": "9" * 40 + "=", "answer": "1"},  # line 6: prompt_too_long (with a tokenizer)
    {"messages": [{"role": "user"}], "answer": "1"},  # line 7: bad_messages
    {"prompt": "1+2=", "answer": "3", "metadata": [1]},  # line 8: bad_metadata
    {"prompt": "1+3=", "answer": 4, "metadata": {"level": 1}},  # line 9: valid, int answer
    "",  # line 10: blank, not a row
    {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"},  # line 11: valid
]


def test_bad_rows_are_logged_with_file_line_and_counted(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "rows.jsonl", BAD_ROWS)
    config = DatasetConfig(str(path), max_prompt_tokens=16)
    with caplog.at_level(logging.WARNING):
        dataset = PromptDataset(config, tokenizer=build_tokenizer())
    assert [r.uid for r in dataset.records] == ["rows.jsonl:9", "rows.jsonl:11"]
    assert dataset.records[0].answer == "4" and dataset.records[0].metadata == {"level": 1}
    for line, reason in [
        (1, "malformed_json"),
        (2, "not_object"),
        (3, "missing_prompt"),
        (4, "missing_answer"),
        (5, "empty_prompt"),
        (6, "prompt_too_long"),
        (7, "bad_messages"),
        (8, "bad_metadata"),
    ]:
        assert f"{path}:{line}: skipping bad row ({reason})" in caplog.text
    metrics = dataset.metrics()
    assert metrics == {
        **{
            f"data/bad_rows/{reason}": 1.0
            for reason in (
                "bad_messages",
                "bad_metadata",
                "empty_prompt",
                "malformed_json",
                "missing_answer",
                "missing_prompt",
                "not_object",
                "prompt_too_long",
            )
        },
        "data/num_rows": 2.0,
        "data/epoch": 0.0,
    }


def test_on_bad_row_error_names_file_line_and_reason(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", _good_rows(2) + [{"prompt": "x"}])
    with pytest.raises(ConfigError, match=rf"data\.path = .*bad row at {path}:3: missing_answer"):
        PromptDataset(DatasetConfig(str(path), on_bad_row="error"))


def test_no_valid_rows_and_missing_file(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", ["{oops", {"q": 1}])
    with pytest.raises(ConfigError, match="no valid rows.*malformed_json.*missing_prompt"):
        PromptDataset(DatasetConfig(str(path)))
    with pytest.raises(ConfigError, match=r"data\.path = .*nope\.jsonl': file not found"):
        PromptDataset(DatasetConfig(str(tmp_path / "nope.jsonl")))


def test_over_long_limit_without_tokenizer_is_ignored_with_a_warning(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "rows.jsonl", _good_rows(1))
    with caplog.at_level(logging.WARNING):
        dataset = PromptDataset(DatasetConfig(str(path), max_prompt_tokens=1))
    assert len(dataset) == 1 and dataset.records[0].prompt_ids is None
    assert "data.max_prompt_tokens = 1 is ignored" in caplog.text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"path": ""}, "path = '': must be the path"),
        ({"path": "x.csv"}, "cannot tell the format of 'x.csv'"),
        ({"path": "x.jsonl", "format": "csv"}, "format = 'csv': must be one of"),
        ({"path": "x.jsonl", "prompt_key": ""}, "prompt_key = '': must be a non-empty"),
        (
            {"path": "x.jsonl", "max_prompt_tokens": 0},
            "max_prompt_tokens = 0: must be an integer >= 1 or null",
        ),
        (
            {"path": "x.jsonl", "on_bad_row": "drop"},
            "on_bad_row = 'drop': must be one of skip, error",
        ),
        ({"path": "x.jsonl", "shuffle": "yes"}, "shuffle = 'yes': must be true or false"),
        ({"path": "x.jsonl", "seed": -1}, "seed = -1: must be an integer >= 0"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DatasetConfig(**kwargs)


def test_custom_keys_and_explicit_format(tmp_path):
    path = _write_jsonl(tmp_path / "rows.txt", [{"question": "1+1=", "solution": "2"}])
    config = DatasetConfig(str(path), format="jsonl", prompt_key="question", answer_key="solution")
    assert PromptDataset(config).records[0].prompt_text == "1+1="


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        {"prompt": "1+1=", "messages": None, "answer": "2", "metadata": {"level": 1}},
        {"prompt": None, "messages": [{"role": "user", "content": "2+2="}], "answer": "4",
         "metadata": {"level": 2}},
        {"prompt": "", "messages": None, "answer": "0", "metadata": None},
    ]  # fmt: skip
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = PromptDataset(DatasetConfig(str(path), shuffle=False), tokenizer=build_tokenizer())
    assert [r.uid for r in dataset.records] == ["rows.parquet:0", "rows.parquet:1"]
    first, second = dataset.records
    assert (first.prompt_text, first.answer, first.metadata) == ("1+1=", "2", {"level": 1})
    assert second.messages == [{"role": "user", "content": "2+2="}]
    assert dataset.bad_rows == {"empty_prompt": 1}
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        PromptDataset(DatasetConfig(str(_write_jsonl(tmp_path / "bad.parquet", _good_rows(1)))))


def test_encode_prompt_text_and_chat():
    tokenizer = build_tokenizer()
    text = PromptRecord("a:1", None, "3+5=", None, "8")
    chat = PromptRecord("a:2", None, None, [{"role": "user", "content": "3+5="}], "8")
    assert tokenizer.decode(encode_prompt(text, tokenizer)) == "3+5="
    expected = "<|user|>3+5=<eos><|assistant|>"
    assert tokenizer.decode(encode_prompt(chat, tokenizer)) == expected
    assert tokenizer.decode(encode_prompt(text, tokenizer, use_chat_template=True)) == expected


def test_epochs_are_seeded_permutations(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", _good_rows(10))
    dataset = PromptDataset(DatasetConfig(str(path), seed=3))
    epoch0 = [r.uid for r in dataset.next_batch(10)]
    epoch1 = [r.uid for r in dataset.next_batch(10)]
    assert sorted(epoch0) == sorted(epoch1) == sorted(r.uid for r in dataset.records)
    assert epoch0 != epoch1, "each epoch must be re-shuffled"
    assert dataset.cursor.epoch == 2 and dataset.cursor.index == 0
    again = PromptDataset(DatasetConfig(str(path), seed=3))
    assert [r.uid for r in again.next_batch(20)] == epoch0 + epoch1
    in_order = PromptDataset(DatasetConfig(str(path), shuffle=False))
    assert [r.uid for r in in_order.next_batch(12)][:3] == [f"rows.jsonl:{i}" for i in (1, 2, 3)]
    with pytest.raises(ValueError, match="n must be >= 1"):
        in_order.next_batch(0)


def test_resume_continues_the_uninterrupted_sequence(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", _good_rows(7))
    config = DatasetConfig(str(path), seed=11)
    reference = PromptDataset(config)
    expected = [[r.uid for r in reference.next_batch(3)] for _ in range(8)]

    first = PromptDataset(config)
    drawn = [[r.uid for r in first.next_batch(3)] for _ in range(3)]  # stops mid-epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptDataset(config)
    resumed.load_state_dict(state)
    drawn += [[r.uid for r in resumed.next_batch(3)] for _ in range(5)]
    assert drawn == expected


def test_resume_refuses_a_state_for_other_data(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", _good_rows(7))
    state = PromptDataset(DatasetConfig(str(path), seed=11)).state_dict()
    with pytest.raises(ConfigError, match=r"saved for \(rows, seed, shuffle\) = \(7, 11, True\)"):
        PromptDataset(DatasetConfig(str(path), seed=12)).load_state_dict(state)
    state["cursor"]["index"] = 99
    with pytest.raises(ConfigError, match="out of range"):
        PromptDataset(DatasetConfig(str(path), seed=11)).load_state_dict(state)
