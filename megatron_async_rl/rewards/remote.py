"""Remote HTTP reward: a reward computed by a service (a sandbox, a judge model, a grader).

Built by `registry.get_reward(RewardConfig(name="remote", url=...))` and called by the reward
stage like any reward function, usually inside `SafeReward`.

Protocol: one POST per sample to `url` with the JSON body

    {"response": "<response text>", "answer": "<ground truth>", "metadata": {...}}

answered by status 200 and `{"reward": <float>}`. A timeout, a connection error or a 5xx status
is retried up to `max_retries` times, waiting `backoff_s * 2**i` before retry i; a 4xx status,
a body that is not such JSON, or running out of retries raises `RuntimeError` naming the URL,
the attempts and the last error (which `SafeReward` scores 0.0 and counts).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
import urllib.error
import urllib.request

logger = logging.getLogger(__name__)


class RemoteReward:
    """Callable `(response_text, answer, metadata) -> float` backed by an HTTP endpoint."""

    def __init__(self, url: str, timeout_s: float = 10.0, max_retries: int = 3, backoff_s=0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url = {url!r}: must start with http:// or https://")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(
                f"timeout_s = {timeout_s}, max_retries = {max_retries}, backoff_s = {backoff_s}: "
                "need timeout_s > 0, max_retries >= 0, backoff_s >= 0"
            )
        self.url = url
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.num_retries = 0
        """Retries made so far, over all calls (a service-health signal)."""

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, timeout_s={self.timeout_s})"

    def __call__(self, response_text: str, answer: str, metadata: dict) -> float:
        body = json.dumps(
            {"response": response_text, "answer": answer, "metadata": metadata or {}}
        ).encode()
        last_error = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.num_retries += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._post(body)
            except urllib.error.HTTPError as err:
                if err.code < 500:
                    raise RuntimeError(
                        f"remote reward {self.url}: HTTP {err.code} {err.reason} (not retried)"
                    ) from err
                last_error = f"HTTP {err.code} {err.reason}"
            except (TimeoutError, socket.timeout) as err:
                last_error = f"timed out after {self.timeout_s} s ({err})"
            except urllib.error.URLError as err:
                if isinstance(err.reason, (TimeoutError, socket.timeout)):
                    last_error = f"timed out after {self.timeout_s} s ({err.reason})"
                else:
                    last_error = f"connection error: {err.reason}"
            except ConnectionError as err:
                last_error = f"connection error: {err}"
            logger.debug("remote reward %s attempt %d failed: %s", self.url, attempt, last_error)
        raise RuntimeError(
            f"remote reward {self.url}: failed after {self.max_retries + 1} attempt(s); "
            f"last error: {last_error}"
        )

    def _post(self, body: bytes) -> float:
        request = urllib.request.Request(
            self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            raw = response.read()
        try:
            reward = json.loads(raw)["reward"]
        except (ValueError, KeyError, TypeError) as err:
            raise RuntimeError(
                f'remote reward {self.url}: expected JSON {{"reward": <float>}}, got {raw[:200]!r}'
            ) from err
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise RuntimeError(f"remote reward {self.url}: reward {reward!r} is not a number")
        if not math.isfinite(reward):
            raise RuntimeError(f"remote reward {self.url}: reward {reward} is not finite")
        return float(reward)
