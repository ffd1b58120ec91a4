"""Contract of `tasks/arithmetic.py` with `tasks/arithmetic_reward.py`: the quick start's task.

- Written rows are `{"prompt": "a<op>b=", "answer": "<a op b>"}`, seeded (same seed, same
  bytes), read back by `PromptDataset` without a bad row.
- Every prompt character is one token of the tiny tokenizer (`models/tiny.py`), none unknown.
- The `arithmetic` reward gives 1.0 to each row's answer followed by `<eos>` and 0.0 to a wrong
  one: writer and reward agree (the reference answer is recomputed here with Python's operators).
- The held-out split is disjoint from the training problems; bad arguments are ValueErrors
  naming the value and the rule, and the command line writes the files. Nothing is faked.
"""

from __future__ import annotations

import json
import operator

import pytest

from megatron_async_rl.models.tiny import build_tokenizer
from megatron_async_rl.rewards.registry import get_reward
from megatron_async_rl.rollout.dataset import DatasetConfig, PromptDataset
from megatron_async_rl.tasks.arithmetic import (
    all_problems,
    main,
    split_problems,
    write_arithmetic_dataset,
    write_heldout_split,
)

PY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_are_correct_and_seeded(tmp_path):
    path = write_arithmetic_dataset(tmp_path / "a.jsonl", 300, seed=5, max_operand=12, ops="+-*")
    rows = _rows(path)
    assert len(rows) == 300
    for row in rows:
        a, op, b = next(
            (int(row["prompt"][:i]), row["prompt"][i], int(row["prompt"][i + 1 : -1]))
            for i in range(1, len(row["prompt"]))
            if row["prompt"][i] in PY_OPS
        )
        assert row["prompt"].endswith("=") and 0 <= a <= 12 and 0 <= b <= 12
        assert row["answer"] == str(PY_OPS[op](a, b))
    assert {row["prompt"][1:].lstrip("0123456789")[0] for row in rows} == {"+", "-", "*"}
    same = write_arithmetic_dataset(tmp_path / "b.jsonl", 300, seed=5, max_operand=12, ops="+-*")
    other = write_arithmetic_dataset(tmp_path / "c.jsonl", 300, seed=6, max_operand=12, ops="+-*")
    assert same.read_bytes() == path.read_bytes() != other.read_bytes()
    dataset = PromptDataset(DatasetConfig(str(path)))
    assert len(dataset) == 300 and not dataset.bad_rows


def test_prompts_are_single_tiny_tokens():
    tokenizer = build_tokenizer()
    unk = tokenizer.convert_tokens_to_ids("<unk>")
    for a, op, b in all_problems(99, ("+", "-", "*")):
        prompt = f"{a}{op}{b}="
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert len(ids) == len(prompt) and unk not in ids
        assert tokenizer.decode(ids) == prompt


def test_writer_and_reward_agree(tmp_path):
    path = write_arithmetic_dataset(tmp_path / "a.jsonl", 200, seed=0, ops="+-")
    reward = get_reward("arithmetic")
    for row in _rows(path):
        assert reward(row["answer"] + "<eos>", row["answer"], {}) == 1.0
        assert reward(str(int(row["answer"]) + 1) + "<eos>", row["answer"], {}) == 0.0


def test_heldout_split_is_disjoint(tmp_path):
    problems = all_problems(9, ("+",))
    train, heldout = split_problems(problems, 0.2, seed=0)
    assert len(heldout) == 20 and len(train) == 80 and not set(train) & set(heldout)
    assert split_problems(problems, 0.2, seed=0) == (train, heldout)
    train_path, heldout_path = write_heldout_split(
        tmp_path / "train.jsonl", tmp_path / "eval.jsonl", 500, seed=0
    )
    train_prompts = {row["prompt"] for row in _rows(train_path)}
    heldout_prompts = [row["prompt"] for row in _rows(heldout_path)]
    assert len(heldout_prompts) == len(set(heldout_prompts)) == 20
    assert not train_prompts & set(heldout_prompts)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: write_arithmetic_dataset(p, 0, 0), "num_rows = 0: must be an integer >= 1"),
        (lambda p: write_arithmetic_dataset(p, 5, 0, max_operand=0), "max_operand = 0: must"),
        (lambda p: write_arithmetic_dataset(p, 5, 0, ops=("/",)), r"ops = \('/',\): each must"),
        (lambda p: write_arithmetic_dataset(p, 5, 0, problems=[]), "problems is empty"),
        (
            lambda p: split_problems(all_problems(), 1.0, 0),
            "heldout_fraction = 1.0: must be a finite number in",
        ),
        (lambda p: split_problems(all_problems(1), 0.9, 0), "leaves no training problem"),
    ],
)
def test_bad_arguments(tmp_path, call, match):
    with pytest.raises(ValueError, match=match):
        call(tmp_path / "x.jsonl")


def test_command_line(tmp_path):
    out = tmp_path / "arith" / "train.jsonl"
    assert main(["--out", str(out), "--num-rows", "50", "--seed", "0"]) == out
    assert len(_rows(out)) == 50
    heldout = tmp_path / "arith" / "eval.jsonl"
    main(["--out", str(out), "--num-rows", "40", "--heldout-out", str(heldout), "--ops", "+-"])
    assert len(_rows(out)) == 40 and len(_rows(heldout)) == 40  # 20% of 200 problems
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--num-rows", "0"])
