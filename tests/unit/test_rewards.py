"""Contract of `rewards/`: answer extraction, the registry, error isolation and the remote reward.

- `math`: the final answer is the last `\\boxed{}` (nested braces), else "answer is"/"Answer:",
  else the last number; equal numbers in any written form (fractions, decimals, thousands
  separators, scientific notation, `$`) score 1.0, anything else 0.0; `50%` equals 50, not 0.5.
- `get_reward`: registered names, `module:function` plug-ins (a real module written to a temp
  directory on sys.path) and `RewardConfig`; every lookup mistake is a `ConfigError` naming the
  key, the value and why.
- `SafeReward`: an exception or a non-finite value scores 0.0 and is counted in `reward/errors`.
- `RemoteReward`: against a real `http.server` on 127.0.0.1 in a thread (nothing faked): retries
  5xx and timeouts with backoff, does not retry 4xx, gives up with a RuntimeError naming the URL.
"""

from __future__ import annotations

import http.server
import json
import logging
import socket
import sys
import threading
import time

import pytest

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.rewards.config import RewardConfig
from megatron_async_rl.rewards.math_answer import math_reward
from megatron_async_rl.rewards.math_match import extract_answer
from megatron_async_rl.rewards.registry import RewardRequest, SafeReward, get_reward
from megatron_async_rl.rewards.remote import RemoteReward
from megatron_async_rl.tasks.arithmetic_reward import arithmetic_reward


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{{1}}", "1", 1.0),
        ("The answer is 1,000.", "1000", 1.0),
        ("-3", "-3", 1.0),
        ("-3", "3", 0.0),
        ("3.0", "3", 1.0),
        ("no number here", "3", 0.0),
        (r"first \boxed{1}, then \boxed{2}", "2", 1.0),
        (r"first \boxed{1}, then \boxed{2}", "1", 0.0),
        (r"$\boxed{\dfrac{-3}{4}}$", "-0.75", 1.0),
        (r"\boxed{-\frac{3}{4}}", "-3/4", 1.0),
        (r"\boxed{\frac{\frac{1}{2}}{2}}", "0.25", 1.0),
        (r"\boxed{\left( 3 \right)}", "3", 1.0),
        ("Answer: $1,234.50$", "1234.5", 1.0),
        ("The answer is 42 because 6*7=42 and 2", "42", 1.0),
        ("the answer is: 7", "7", 1.0),
        ("50%", "50", 1.0),
        ("50%", "0.5", 0.0),
        (r"\boxed{50\%}", "50", 1.0),
        ("x = 1.5e3", "1500", 1.0),
        (r"about $2.5 \times 10^{3}$", "2500", 1.0),
        ("1/3", "0.3333333", 1.0),  # relative tolerance 1e-6
        ("1/3", "0.33333", 0.0),
        ("\u22127", "-7", 1.0),  # Unicode minus
        (r"\boxed{x+1}", "x + 1", 1.0),  # non-numeric answers compare as normalised text
        ("so 7.", "7", 1.0),
        ("7", r"\boxed{7}", 1.0),  # a boxed ground truth is extracted too
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer, {}) == expected


def test_extract_answer_rules_in_order():
    assert extract_answer(r"answer is 5, \boxed{6}") == "6"
    assert extract_answer("Answer: 5. Then 9 more") == "5"
    assert extract_answer("3 apples and 4 pears") == "4"
    assert extract_answer(r"cut off \boxed{3") == "3"  # unbalanced box: falls back to the number
    assert extract_answer("nothing") is None


def test_arithmetic_reward():
    assert arithmetic_reward("8<eos>", "8", {}) == 1.0
    assert arithmetic_reward(" 8 then more", "8", {}) == 1.0
    assert arithmetic_reward("08<eos><pad>", "8", {}) == 1.0
    assert arithmetic_reward("-3<eos>", "-3", {}) == 1.0
    assert arithmetic_reward("9<eos>", "8", {}) == 0.0
    assert arithmetic_reward("8+0<eos>", "8", {}) == 0.0
    assert arithmetic_reward("<eos>", "8", {}) == 0.0
    assert arithmetic_reward("", "8", {}) == 0.0


def test_registered_names_resolve():
    assert get_reward("math") is math_reward
    assert get_reward(RewardConfig(name="arithmetic")) is arithmetic_reward


def test_plugin_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_reward_plugin.py").write_text(
        "def score(response_text, answer, metadata):\n"
        "    return float(response_text.strip() == answer) * metadata.get('scale', 1.0)\n"
        "NOT_A_FUNCTION = 3\n"
        "def wrong_arity(response_text):\n"
        "    return 0.0\n"
        "def plausible(prompt, response, answer=None, **kw):\n"  # the new-user trial's trap
        "    return 1.0\n"
        "def extra_required(response_text, answer, metadata, scale):\n"
        "    return 1.0\n"
        "def extra_default(response_text, answer, metadata, scale=1.0, **kw):\n"
        "    return scale\n"
    )
    (tmp_path / "broken_reward_plugin.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("my_reward_plugin:score")
    assert fn("yes", "yes", {"scale": 2.0}) == 2.0
    with pytest.raises(ConfigError, match=r"reward\.name = 'my_reward_plugin:nope': .*no attrib"):
        get_reward("my_reward_plugin:nope")
    with pytest.raises(ConfigError, match="is a int, not a function"):
        get_reward("my_reward_plugin:NOT_A_FUNCTION")
    for name in ("wrong_arity", "plausible", "extra_required"):
        with pytest.raises(ConfigError, match=r"the contract is fn\(response_text, answer, "
                           r"metadata\) -> float, in that order"):  # fmt: skip
            get_reward(f"my_reward_plugin:{name}")
    assert get_reward("my_reward_plugin:extra_default")("a", "b", {}) == 1.0
    with pytest.raises(ConfigError, match="cannot import module 'broken_reward_plugin'.*boom"):
        get_reward("broken_reward_plugin:score")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'"):
        get_reward("no_such_module_xyz:score", key="rewards[0].name")
    sys.modules.pop("my_reward_plugin", None)


@pytest.mark.parametrize(
    "spec, key, match",
    [
        ("maht", "reward.name", r"reward\.name = 'maht': unknown reward name; .*did you mean math"),
        (":score", "reward.name", "expected module:function"),
        ("a:b:c", "reward.name", "expected module:function"),
        ("", "x.reward", r"x\.reward = '': must be a reward name"),
        ("remote", "reward.name", "the remote reward needs a URL"),
    ],
)
def test_lookup_errors(spec, key, match):
    with pytest.raises(ConfigError, match=match):
        get_reward(spec, key=key)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "remote"}, r"url = None: remote reward needs an http"),
        ({"name": "remote", "url": "ftp://x"}, "remote reward needs an http"),
        ({"name": "math", "timeout_s": 0}, "timeout_s = 0: must be a finite number of seconds > 0"),
        ({"name": "math", "max_retries": -1}, "max_retries = -1: must be an integer >= 0"),
        ({"name": "math", "max_retries": 1.5}, "max_retries = 1.5: must be an integer >= 0"),
        (
            {"name": "math", "backoff_s": "1"},
            "backoff_s = '1': must be a finite number of seconds >= 0",
        ),
        ({"name": " "}, "must be a reward name"),
    ],
)
def test_reward_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RewardConfig(**kwargs)


def test_reward_config_warns_about_an_ignored_url(caplog):
    with caplog.at_level(logging.WARNING):
        RewardConfig(name="math", url="http://127.0.0.1:1/")
    assert "reward.url = 'http://127.0.0.1:1/' is ignored" in caplog.text


def test_safe_reward_counts_failures_and_scores_zero(caplog):
    def flaky(response_text, answer, metadata):
        if response_text == "raise":
            raise KeyError("missing field")
        if response_text == "nan":
            return float("nan")
        if response_text == "str":
            return "1.0"
        return 1.0

    safe = SafeReward(flaky, name="flaky", max_logged=2)
    samples = [RewardRequest(f"s{i}", text, "1") for i, text in enumerate(["ok", "raise", "nan"])]
    with caplog.at_level(logging.WARNING):
        assert safe.score(samples) == [1.0, 0.0, 0.0]
        assert safe("str", "1", {}, uid="s3") == 0.0
    assert safe.metrics() == {"reward/errors": 3.0, "reward/timeouts": 0.0, "reward/calls": 4.0}
    assert "sample s1" in caplog.text and "KeyError" in caplog.text
    assert "sample s3" not in caplog.text  # only the first max_logged failures are logged


class _Handler(http.server.BaseHTTPRequestHandler):
    """POST /ok: reward 0.75 x len(response); /flaky: 503 twice then ok; /slow: sleeps 1 s;
    /bad: 400; /garbage: 200 with a non-JSON body."""

    calls: dict[str, int] = {}

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        count = self.calls[self.path] = self.calls.get(self.path, 0) + 1
        if self.path == "/flaky" and count <= 2:
            return self._reply(503, b"busy")
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path == "/bad":
            return self._reply(400, b"bad request")
        if self.path == "/garbage":
            return self._reply(200, b"not json")
        reward = 0.75 * len(body["response"]) + (body["answer"] == "a") + body["metadata"]["k"]
        self._reply(200, json.dumps({"reward": reward}).encode())

    def _reply(self, status, payload):
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # /slow: the client timed out and hung up, as the test intends

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Handler.calls = {}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def test_remote_reward_round_trip_and_retries(server):
    fn = get_reward(RewardConfig(name="remote", url=f"{server}/ok", timeout_s=5))
    assert fn("abcd", "a", {"k": 1}) == pytest.approx(5.0)
    flaky = RemoteReward(f"{server}/flaky", timeout_s=5, max_retries=2, backoff_s=0.01)
    assert flaky("ab", "b", {"k": 0}) == pytest.approx(1.5)
    assert _Handler.calls["/flaky"] == 3 and flaky.num_retries == 2


def test_remote_reward_gives_up(server):
    flaky = RemoteReward(f"{server}/flaky", timeout_s=5, max_retries=1, backoff_s=0.01)
    with pytest.raises(RuntimeError, match=r"/flaky: failed after 2 attempt\(s\).*HTTP 503"):
        flaky("x", "y", {"k": 0})
    slow = RemoteReward(f"{server}/slow", timeout_s=0.2, max_retries=1, backoff_s=0.01)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="failed after 2 attempt.*timed out after 0.2 s"):
        slow("x", "y", {"k": 0})
    assert time.monotonic() - start < 3
    with pytest.raises(RuntimeError, match="HTTP 400 .*not retried"):
        RemoteReward(f"{server}/bad", max_retries=3, backoff_s=0.01)("x", "y", {"k": 0})
    assert _Handler.calls["/bad"] == 1
    with pytest.raises(RuntimeError, match=r"expected JSON \{\"reward\""):
        RemoteReward(f"{server}/garbage")("x", "y", {"k": 0})


def test_remote_reward_connection_refused_inside_safe_reward():
    with socket.socket() as probe:  # a loopback port that was free a moment ago: refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    safe = SafeReward(RemoteReward(f"http://127.0.0.1:{port}/ok", max_retries=1, backoff_s=0.01))
    assert safe.score([RewardRequest("u0", "x", "y", {"k": 0})]) == [0.0]
    assert safe.metrics()["reward/errors"] == 1.0
    assert safe.fn.num_retries == 1


def test_a_reward_failing_on_most_samples_stops_the_run():
    """`reward.max_error_rate`: more than that share of one step's samples failing is a
    ConfigError naming the key, the count and the first failure; `reward/errors` is per step
    (`take_metrics`), `reward/errors_total` since the start."""
    from types import SimpleNamespace

    def broken(response_text, answer, metadata):
        if response_text == "bad":
            raise KeyError("prompt")
        return 1.0

    samples = [SimpleNamespace(response_text=t, answer="a", metadata={}) for t in
               ("bad", "ok", "ok", "ok")]  # fmt: skip
    safe = SafeReward(broken, name="broken", max_error_rate=0.5)
    assert safe.score(samples) == [0.0, 1.0, 1.0, 1.0]  # 1 of 4 failed: below the rate
    assert safe.take_metrics() == {"reward/errors": 1.0, "reward/timeouts": 0.0,
                                   "reward/calls": 4.0, "reward/errors_total": 1.0}  # fmt: skip
    all_bad = [SimpleNamespace(response_text="bad", answer="a", metadata={})] * 4
    stop = r"reward.max_error_rate = 0.5: reward broken failed on 4 of the 4 samples of one step"
    with pytest.raises(ConfigError, match=stop + r" \(the first failure: KeyError: 'prompt'\)"):
        safe.score(all_bad)
    assert safe.take_metrics()["reward/errors"] == 4.0  # this step's, not the total (5)
    assert SafeReward(broken, max_error_rate=1.0).score(all_bad) == [0.0] * 4  # never stops


def test_async_and_batched_rewards_take_a_step_at_once():
    import asyncio

    running, peak = [0], [0]

    async def judge(response_text, answer, metadata):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1
        if response_text == "boom":
            raise ValueError("judge failed")
        return float(response_text == answer)

    safe = SafeReward(judge, "judge")
    samples = [RewardRequest(f"u{i}", r, "8") for i, r in enumerate(["8", "7", "boom", "8"])]
    start = time.perf_counter()
    assert safe.score(samples) == [1.0, 0.0, 0.0, 1.0]
    assert time.perf_counter() - start < 0.15 and peak[0] == 4  # concurrent, not one by one
    assert safe.take_metrics()["reward/errors"] == 1.0
    assert safe("8", "8", {}) == 1.0  # called alone too

    class Batched:
        calls = 0

        def __call__(self, response_text, answer, metadata):
            return float(response_text == answer)

        def score_batch(self, items):
            Batched.calls += 1
            return [float(r == a) if r != "bad" else TypeError("bad") for r, a, _ in items]

    safe = SafeReward(Batched(), "batched")
    got = safe.score([RewardRequest("a", "8", "8"), RewardRequest("b", "bad", "8")])
    assert got == [1.0, 0.0] and Batched.calls == 1
    assert safe.take_metrics()["reward/errors"] == 1.0


def test_the_reward_metadata_holds_the_prompt_and_the_row(tmp_path):
    from megatron_async_rl.rollout.config import DatasetConfig
    from megatron_async_rl.rollout.dataset import PromptDataset

    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"prompt": "3+5=", "answer": 8, "level": 2, "metadata": {"src": "x"}}) + "\n"
        + json.dumps({"prompt": "no answer"}) + "\n"
    )  # fmt: skip
    strict = PromptDataset(DatasetConfig(path=str(path)))
    assert len(strict) == 1  # the row without an answer is a bad row by default
    record = strict.records[0]
    meta = record.reward_metadata()
    assert meta["src"] == "x" and meta["prompt"] == "3+5="
    assert meta["row"] == {"prompt": "3+5=", "answer": 8, "level": 2}
    lenient = PromptDataset(DatasetConfig(path=str(path), answer_required=False))
    assert [r.answer for r in lenient.records] == ["8", ""]
