"""The `math` reward's grader against other projects' grader tests, and its throughput.

    .venv/bin/python benchmarks/math_grader.py [--corpus tests/data/math_grader_corpus.jsonl]
        [--workers 2] [--repeat 4] [--metrics RUN_DIR/metrics.jsonl]

Side by side in one run, on the corpus (601 cases from Math-Verify, NeMo-Skills, AReaL,
SkyThought, hendrycks/math and others, with their verdicts: `tests/data/math_grader_corpus.md`):
- agreement with the sources' verdicts of the old grader (our answer extraction and match
  alone, what `math` was before Math-Verify), of Math-Verify alone (`verify(parse(gold),
  parse(response))`), and of the `math` reward (`rewards/math_grade.py`), overall and per
  category;
- throughput in samples/s: the old grader in this process, and the `math` reward's
  `score_batch` (fast match here, Math-Verify in `--workers` processes) on the corpus repeated
  `--repeat` times, pool started beforehand (its start-up is printed apart);
- with `--metrics`, a run's stage times (`timing/*`): the reward stage's share of the step.
Prints `RESULT agreement=<math reward> old=<old grader> math_verify=<alone> samples_per_s=...`.
A benchmark, not a test (the test of agreement >= 0.95 is `tests/unit/test_math_grade.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _old(response: str, answer: str) -> bool:
    from megatron_async_rl.rewards.math_match import answers_match, extract_answer, last_boxed

    predicted = extract_answer(response)
    truth = last_boxed(answer)
    return predicted is not None and answers_match(predicted, truth if truth else answer)


def _math_verify_alone(response: str, answer: str) -> bool:
    from math_verify import parse, verify

    return verify(parse(answer), parse(response))


def _agreement(rows: list[dict], fn) -> tuple[float, dict[str, float], float]:
    hits, per = 0, defaultdict(list)
    start = time.perf_counter()
    for row in rows:
        try:
            verdict = fn(row["response"], row["gold"])
        except Exception:  # noqa: BLE001 - a grader that raises gets the case wrong
            verdict = None
        hit = verdict == row["expected"]
        hits += hit
        per[row["category"]].append(hit)
    elapsed = time.perf_counter() - start
    return hits / len(rows), {k: sum(v) / len(v) for k, v in per.items()}, elapsed


def _stage_times(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keys = sorted({k for r in rows for k in r if k.startswith("timing/")})
    means = {k: statistics.mean(r[k] for r in rows if k in r) for k in keys}
    step = means.get("timing/step_s")
    print(f"stage times of {path} (mean over {len(rows)} steps):")
    for key, value in means.items():
        share = f" ({value / step:.0%} of the step)" if step and key != "timing/step_s" else ""
        print(f"  {key} {value:.4f} s{share}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(REPO / "tests/data/math_grader_corpus.jsonl"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--metrics", default=None, help="a run's metrics.jsonl")
    args = parser.parse_args()
    from megatron_async_rl.rewards.math_answer import MathReward
    from megatron_async_rl.rewards.math_grade import grade

    rows = [json.loads(line) for line in Path(args.corpus).read_text().splitlines() if line]
    results = {
        "old grader": _agreement(rows, _old),
        "Math-Verify alone": _agreement(rows, _math_verify_alone),
        "math reward": _agreement(rows, grade),
    }
    categories = sorted({r["category"] for r in rows})
    print(f"{len(rows)} cases; agreement with the sources' verdicts:")
    print(f"{'category':22s}{'cases':>6s}" + "".join(f"{name:>20s}" for name in results))
    for category in categories:
        count = sum(r["category"] == category for r in rows)
        print(f"{category:22s}{count:6d}" + "".join(
            f"{per[category]:20.3f}" for _, per, _ in results.values()))  # fmt: skip
    print(f"{'all':22s}{len(rows):6d}" + "".join(f"{a:20.3f}" for a, _, _ in results.values()))

    batch = [(r["response"], r["gold"], {}) for r in rows] * args.repeat
    start = time.perf_counter()
    for response, answer, _ in batch:
        _old(response, answer)
    old_rate = len(batch) / (time.perf_counter() - start)
    reward = MathReward(workers=args.workers)
    start = time.perf_counter()
    reward.score_batch(batch[:2] + [("$\\sqrt{2}$", "\\sqrt{2}+0", {})] * 2)  # starts the pool
    startup = time.perf_counter() - start
    start = time.perf_counter()
    reward.score_batch(batch)
    rate = len(batch) / (time.perf_counter() - start)
    reward.close()
    print(f"throughput on {len(batch)} samples: old grader {old_rate:.0f} samples/s in this "
          f"process; math reward {rate:.0f} samples/s (fast match here, Math-Verify in "
          f"{args.workers} processes; its start-up {startup:.1f} s, once per run)")  # fmt: skip
    if args.metrics:
        _stage_times(Path(args.metrics))
    agreement = {name: a for name, (a, _, _) in results.items()}
    print(f"RESULT agreement={agreement['math reward']:.4f} old={agreement['old grader']:.4f} "
          f"math_verify={agreement['Math-Verify alone']:.4f} samples_per_s={rate:.0f} "
          f"old_samples_per_s={old_rate:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
