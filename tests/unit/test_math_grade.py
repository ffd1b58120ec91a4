"""The `math` reward's grader (`rewards/math_grade.py`) and its Math-Verify pool (`math_pool.py`).

Contracts:
- on `tests/data/math_grader_corpus.jsonl` (601 cases from other projects' grader tests, their
  verdicts) `grade` agrees with at least 95% (the old grader: 68%; `benchmarks/math_grader.py`
  prints both);
- the forms the old grader rejected, each right and wrong: equations, intervals, sets, tuples,
  matrices, radicals, units and `\\text{}`, LaTeX expressions, choice letters; the percent rule
  (`50%` is 50, not 0.5) holds;
- `MathReward.score_batch` through a pool of 2 worker processes gives `grade`'s verdicts, and
  `SafeReward.score` uses it (one batch, every sample counted);
- a pool whose answers do not come within `call_timeout_s` reports them as timeouts (counted
  as `reward/timeouts`), kills its workers and grades the next batch with fresh ones.
Real Math-Verify, real processes; nothing is faked.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from megatron_async_rl.rewards.math_answer import MathReward
from megatron_async_rl.rewards.math_grade import grade, quick_grade
from megatron_async_rl.rewards.math_pool import GradePool
from megatron_async_rl.rewards.registry import SafeReward
from tests.processes import cmdline

CORPUS = Path(__file__).resolve().parents[1] / "data" / "math_grader_corpus.jsonl"


def _corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def test_agreement_with_other_projects_grader_tests():
    rows = _corpus()
    assert len(rows) >= 300
    wrong = [r["id"] for r in rows if grade(r["response"], r["gold"]) != r["expected"]]
    agreement = 1 - len(wrong) / len(rows)
    assert agreement >= 0.95, (agreement, wrong)


@pytest.mark.parametrize(
    "response, answer, right",
    [
        (r"so $x = 3$", "3", True),
        (r"\boxed{x = 4}", "3", False),
        (r"The solution set is $\boxed{[1, 2)}$.", r"[1,2)", True),
        (r"$\boxed{(1, 2]}$", r"[1,2)", False),
        (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}", True),
        (r"\boxed{(1, 2)}", r"(1,2)", True),
        (r"\boxed{(2, 1)}", r"(1,2)", False),
        (r"\boxed{\begin{bmatrix}1 & 2\\3 & 4\end{bmatrix}}",
         r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", True),
        (r"\boxed{\begin{pmatrix}1 & 2\\3 & 5\end{pmatrix}}",
         r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", False),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),
        (r"\boxed{3\sqrt{2}}", r"\sqrt{8}", False),
        (r"The answer is \boxed{10\text{ cm}}", "10", True),
        (r"\boxed{\frac{x^2-1}{x-1}}", "x+1", True),
        (r"\boxed{(x+1)^2}", "x^2+2x+1", True),
        (r"\boxed{(x+1)^2}", "x^2+1", False),
        (r"the answer is (C)", "C", True),
        (r"\boxed{\textbf{(B)}}", "C", False),
        (r"\boxed{50\%}", "0.5", False),  # the percent rule: 50% is 50
        (r"\boxed{50\%}", "50", True),
    ],
)  # fmt: skip
def test_forms_the_old_grader_rejected(response, answer, right):
    assert grade(response, answer) is right


def test_quick_grade_decides_only_what_it_can():
    assert quick_grade(r"\boxed{7}", "7") is True
    assert quick_grade(r"\boxed{2\sqrt{2}}", r"\sqrt{8}") is None  # Math-Verify's to decide
    assert quick_grade("the answer is (B)", "C") is False


def test_batches_through_the_pool_give_grade_verdicts():
    rows = [r for r in _corpus() if quick_grade(r["response"], r["gold"]) is None][:24]
    reward = MathReward(workers=2)
    try:
        values = reward.score_batch([(r["response"], r["gold"], {}) for r in rows])
        assert values == [float(grade(r["response"], r["gold"])) for r in rows]
        assert len(reward._pool.pool._executor()._processes) == 2
        safe = SafeReward(reward, "math")
        samples = [SimpleNamespace(uid=r["id"], response_text=r["response"], answer=r["gold"],
                                   metadata={}) for r in rows]  # fmt: skip
        assert safe.score(samples) == values
        assert safe.take_metrics()["reward/calls"] == len(rows)
    finally:
        reward.close()


def test_a_pool_that_does_not_answer_in_time_is_replaced():
    pool = GradePool(workers=1, call_timeout_s=0.001)  # less than a worker's start
    try:
        out = pool.grade_many([(r"\boxed{2\sqrt{2}}", r"\sqrt{8}")] * 3)
        assert all(isinstance(o, TimeoutError) for o in out), out
        assert pool.pool._pool is None  # replaced: its worker was killed
        children = [p for p in psutil.Process().children() if "multiprocessing" in cmdline(p)]
        psutil.wait_procs(children, timeout=10)
        pool.call_timeout_s = 60.0
        assert pool.grade_many([(r"\boxed{2\sqrt{2}}", r"\sqrt{8}")]) == [True]
        safe = SafeReward(MathReward(workers=1, call_timeout_s=0.001), "math")
        sample = SimpleNamespace(uid="u", response_text=r"\boxed{3\sqrt{2}}", answer=r"\sqrt{8}",
                                 metadata={})  # fmt: skip
        assert safe.score([sample, sample]) == [0.0, 0.0]
        assert safe.take_metrics()["reward/timeouts"] == 2.0
        safe.fn.close()
    finally:
        pool.close()
