"""Our fast answer match for math: the answer a text states, normalised, and compared.

Owned here: `extract_answer`, `normalize`, `parse_number`, `answers_match` and `last_boxed`,
public for evaluation scripts and tests; `ANSWER_PHRASE` (the "answer is" / "answer:" pattern)
is shared with `math_grade`. Called by `math_grade` (the verdict's first rule) and so by the
`math` reward (`math_answer.MathReward`). Pure: no Math-Verify, no torch.

Extraction, first rule that applies:
1. the content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched, so nesting works;
2. the text after the last "answer is" / "answer:" (any case), up to the end of its line;
   when that is not a number by itself, the first number in it;
3. the last number in the text.
A ground truth written with `\\boxed{}` is extracted the same way; otherwise it is taken whole.

Normalisation: `$`, `\\$`, spaces, `\\left`/`\\right`, `\\!`/`\\,`, `\\text{}`/`\\mathrm{}`
wrappers, `^\\circ` and a trailing period are dropped; thousands separators go (`1,000` ->
`1000`, but `1,2` stays a pair); `\\frac{a}{b}` (and `dfrac`, `tfrac`) becomes `a/b`;
`\\times 10^{k}` and `e` notation become scientific numbers; the Unicode minus becomes `-`.

Percent (a choice): a `%` or `\\%` sign is dropped, so `50%` matches `50` and not `0.5`. Datasets
(GSM8K, MATH) write the number a question asks for as a percentage without the sign, and a model
answering `0.5` to "what percent" is wrong.

Two answers match when both parse as numbers (integers, decimals, `a/b`, scientific) equal
within a relative tolerance of 1e-6, or, failing that, when their normalised strings are equal.
"""

from __future__ import annotations

import math
import re

REL_TOL = 1e-6
_BOX_COMMANDS = ("\\boxed", "\\fbox")
ANSWER_PHRASE = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.*)", re.IGNORECASE)
_NUMBER = re.compile(
    r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?"
    r"|-?\.\d+(?:[eE][-+]?\d+)?"
)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_SHORT_FRAC = re.compile(r"\\[dt]?frac(\d)(\d)")
_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\s*\{([^{}]*)\}")
_TIMES_TEN = re.compile(r"\s*(?:\\times|\\cdot|\*|x)\s*10\s*\^\s*\{?\s*(-?\d+)\s*\}?")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}`, nested braces matched."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for index in range(brace, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : index]
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(text: str) -> str | None:
    """The final answer a response states (see the module docstring), or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    phrases = list(ANSWER_PHRASE.finditer(text))
    if phrases:
        candidate = phrases[-1].group(1).strip()
        if candidate and parse_number(normalize(candidate)) is not None:
            return candidate
        numbers = _NUMBER.findall(text[phrases[-1].start(1) :].replace("\u2212", "-"))
        if numbers:
            return numbers[0]
    numbers = _NUMBER.findall(_TIMES_TEN.sub(r"e\1", text.replace("\u2212", "-")))
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    """The answer with formatting removed (see the module docstring); may still be non-numeric."""
    text = answer.strip().replace("\u2212", "-")
    text = text.replace("\\$", "").replace("$", "")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("\\!", "").replace("\\,", "").replace("\\;", "")
    text = text.replace("\\%", "").replace("%", "")
    text = text.replace("^\\circ", "").replace("^{\\circ}", "")
    text = _WRAPPER.sub(r"\1", text)
    text = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), text)
    text = "".join(text.split())
    previous = None
    while previous != text:  # innermost fractions first, so \frac{\frac{1}{2}}{3} unfolds
        previous = text
        text = _FRAC.sub(r"(\1)/(\2)", text)
    text = _SHORT_FRAC.sub(r"(\1)/(\2)", text)
    text = _TIMES_TEN.sub(r"e\1", text)
    while text.endswith(".") and len(text) > 1:
        text = text[:-1]
    while len(text) > 2 and text[0] == "{" and text[-1] == "}":
        text = text[1:-1]
    return text


def parse_number(text: str) -> float | None:
    """A normalised answer as a float (`3`, `-0.5`, `1e-3`, `(1)/(2)`, `-1/2`), else None."""
    text = text.strip()
    while len(text) > 2 and text[0] in "({" and text[-1] in ")}" and _balanced(text[1:-1]):
        text = text[1:-1]
    if text.startswith("-") and len(text) > 1 and not text[1:].startswith("-"):
        inner = parse_number(text[1:])
        return None if inner is None else -inner
    slash = _last_top_level_slash(text)
    if slash is not None:
        top, bottom = parse_number(text[:slash]), parse_number(text[slash + 1 :])
        if top is None or bottom is None or bottom == 0:
            return None
        return top / bottom
    if not re.fullmatch(r"\+?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?", text, re.IGNORECASE):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _last_top_level_slash(text: str) -> int | None:
    """Index of the last `/` outside brackets: `a/b/c` is `(a/b)/c`."""
    depth, found = 0, None
    for index, char in enumerate(text):
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(char, 0)
        if char == "/" and depth == 0:
            found = index
    return found


def _balanced(text: str) -> bool:
    depth = 0
    for char in text:
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def answers_match(predicted: str, truth: str) -> bool:
    """Whether two answers are the same number (relative tolerance 1e-6) or the same text."""
    left, right = normalize(predicted), normalize(truth)
    left_value, right_value = parse_number(left), parse_number(right)
    if left_value is not None and right_value is not None:
        return math.isclose(left_value, right_value, rel_tol=REL_TOL, abs_tol=1e-12)
    return bool(left) and left == right
