"""Is a response's answer to a math question right? Our fast match first, Math-Verify for the rest.

Owned here: `grade` (the verdict, pure, run where Math-Verify's timeouts work: a process's main
thread) and `quick_grade` (the part that needs no Math-Verify: microseconds). The `math` reward
(`rewards/math_answer.py`) calls `quick_grade` in the rank and sends what it leaves undecided to
a pool of worker processes (`rewards/math_pool.py`) that run `grade`.

`grade(response, answer)`, first rule that decides:
1. **Fast match** (ours, `math_match.answers_match`): the answer the response states in a
   `\\boxed{}` or after "answer is" / "Answer:", or the whole response when it is that short,
   equals the ground truth as a number (any written form) or as normalised text. Only a match
   decides here: a mismatch goes on (Math-Verify knows forms we do not). The last bare number of
   a long text is not used here: it is often not the answer (Math-Verify's own extraction
   decides those). Two plain numbers (`12`, `-0.5`, `1,000`) that differ decide a mismatch.
2. **Letters**: a ground truth that is one choice letter (`C`, `(C)`, `\\text{C}`) matches the
   response's stated letter in any of those forms, case-insensitively.
3. **Math-Verify** (`math_verify.parse` and `verify`, the library verl, TRL and open-r1 use):
   the ground truth is read as written and, without `$`/`\\boxed`, also as LaTeX (`$...$`); the
   response is read as Math-Verify extracts it, and also our stated answer and, when short, the
   whole response as LaTeX. Any pair that Math-Verify finds equivalent scores. That covers
   equations (`x = 3` vs `3`), intervals and inequalities, sets and tuples, matrices, radicals,
   units and `\\text{}`, and symbolic equality of expressions.

Percent: as in our fast match, a `%` sign is dropped (`50%` matches `50`, not `0.5`).

Agreement with other projects' grader tests: `benchmarks/math_grader.py` on
`tests/data/math_grader_corpus.jsonl` (601 cases, their verdicts).
"""

from __future__ import annotations

import re

from megatron_async_rl.rewards.math_match import (
    ANSWER_PHRASE,
    answers_match,
    last_boxed,
    normalize,
)

PARSE_TIMEOUT_S = 3
"""Math-Verify's own bound on parsing one expression (signal-based: main thread only)."""
VERIFY_TIMEOUT_S = 3
"""Math-Verify's own bound on one comparison (likewise)."""
SHORT = 200
"""A response this short (characters) is also read whole as LaTeX, and matched whole."""

_PLAIN_NUMBER = re.compile(r"[-+]?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.\d+)?")
_PERCENT = re.compile(r"\\?%")
_LETTER_WRAPPERS = re.compile(r"\\(?:textbf|text|mathrm|mathbf)\s*")
_LETTER = re.compile(r"^[A-Ea-e]$")


def stated_answer(response: str) -> str | None:
    """The answer a response states: its last `\\boxed{}` or the text after its last "answer
    is" / "Answer:" (to the end of that line), whichever comes later (a response that boxes
    steps and then states "The final answer is ..." means the statement), else the whole
    response when short."""
    phrases = list(ANSWER_PHRASE.finditer(response))
    box_at = max(response.rfind(command) for command in ("\\boxed", "\\fbox"))
    if phrases and phrases[-1].start() > box_at:
        stated = phrases[-1].group(1).strip().rstrip(".")
        boxed = last_boxed(stated)
        return boxed if boxed is not None else (stated or None)
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    return response.strip() if len(response) <= SHORT else None


def _letter(text: str) -> str | None:
    """`C`, `(C)`, `\\text{C}`, `\\textbf{(c)}.` -> "C"; anything else -> None."""
    bare = _LETTER_WRAPPERS.sub("", text).strip().strip("$(){}.: ").strip()
    return bare.upper() if _LETTER.match(bare) else None


def _truth(answer: str) -> str:
    boxed = last_boxed(answer)
    return boxed if boxed is not None else answer


def quick_grade(response: str, answer: str) -> bool | None:
    """True or False where our rules decide (rules 1 and 2), None where Math-Verify must."""
    answer = str(answer)
    stated = stated_answer(response)
    letter = _letter(_truth(answer))
    if letter is not None:
        return stated is not None and _letter(stated) == letter
    truth = _truth(answer)
    if stated is not None and answers_match(stated, truth):
        return True
    if stated is not None and "=" in stated and "=" not in truth:  # `x = 1.5e3` for 1500
        if answers_match(stated.rsplit("=", 1)[1], truth):
            return True
    if normalize(response) == normalize(answer):
        return True
    if stated is not None and _plain_number(stated) and _plain_number(truth):
        return False  # two plain numbers that differ: nothing for Math-Verify to find
    return None


def _plain_number(text: str) -> bool:
    """A number written plainly (`12`, `-0.5`, `1,000`): no fraction, root, unit or percent."""
    return _PLAIN_NUMBER.fullmatch(text.strip().strip("$").strip()) is not None


def grade(response: str, answer: str, timeouts: bool = True) -> bool:
    """The verdict (module docstring). `timeouts`: Math-Verify's signal-based bounds, which
    only work on a process's main thread (False elsewhere: then nothing bounds a call)."""
    quick = quick_grade(response, answer)
    if quick is not None:
        return quick
    from math_verify import parse, verify

    parse_s = PARSE_TIMEOUT_S if timeouts else None
    verify_s = VERIFY_TIMEOUT_S if timeouts else None

    def read(text: str) -> list:
        return parse(text, parsing_timeout=parse_s)

    answer = str(answer)
    response = _PERCENT.sub("", response)  # `50%` is 50 (module docstring), not 0.5
    truths = [read(answer)]
    if "$" not in answer and "\\boxed" not in answer:
        truths.append(read(f"${answer}$"))
    preds = [read(response)]
    stated = stated_answer(response)
    if stated is not None and stated != response:
        preds.append(read(f"${stated}$"))
    if "$" not in response and "\\boxed" not in response and len(response) <= SHORT:
        preds.append(read(f"${response}$"))
    return any(
        verify(truth, pred, timeout_seconds=verify_s)
        for truth in truths if truth
        for pred in preds if pred
    )  # fmt: skip
