"""One error type for every mistake a user can make in a recipe, a `--set` or a Megatron flag.

`ConfigError` carries the key (a dotted recipe path such as `roles.groups[1].num_ranks`, or a
Megatron flag such as `--hidden-size`), the value received, the rule it broke and an optional hint,
and renders them on one line. `exit_on_config_error` is what entry points wrap their config step
in: a user sees `error: <message>` and exit status 2, never a traceback. `warn_once` is the one
warning about a setting that is ignored or adjusted, logged once per process whoever asks.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

logger = logging.getLogger(__name__)

_MAX_VALUE_CHARS = 80


class _NoValue:
    """Marks an error about a key that has no value (missing key, missing flag value)."""

    def __repr__(self) -> str:
        return "<no value>"


NO_VALUE: Any = _NoValue()


def _render_value(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    text = " ".join(text.split())  # keep the message on one line
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text


class ConfigError(ValueError):
    """A user's configuration mistake: key, value received, rule broken, and how to fix it."""

    def __init__(
        self, key: str, value: Any, rule: str, hint: str | None = None, rank_local: bool = False
    ):
        self.key = key
        self.value = value
        self.rule = rule
        self.hint = hint
        self.rank_local = rank_local
        """Found on some ranks only (e.g. one host's /dev/shm): each reports it with its rank."""
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.key if self.value is NO_VALUE else f"{self.key} = {_render_value(self.value)}"
        text = f"config error: {where}: {self.rule}"
        if self.hint:
            text += f"; hint: {self.hint}"
        return " ".join(text.split())

    def __reduce__(self):
        # ValueError pickles as cls(*args); rebuild from the fields instead (errors may cross
        # process boundaries in spawned workers).
        return (ConfigError, (self.key, self.value, self.rule, self.hint))

    def with_prefix(self, prefix: str) -> ConfigError:
        """The same error with its key placed under `prefix` (a dotted recipe path)."""
        if not prefix or self.key.startswith("--"):
            return self
        sep = "" if self.key.startswith("[") else "."
        return ConfigError(f"{prefix}{sep}{self.key}", self.value, self.rule, self.hint)


class ConfigErrors(ConfigError):
    """Several mistakes found in one pass (e.g. one command line of Megatron flags): reported
    together, one line each, so a user fixes them all at once. Behaves as its first error."""

    def __init__(self, errors: list[ConfigError]):
        if not errors:
            raise ValueError("ConfigErrors needs at least one error")
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.key, first.value, first.rule, first.hint)

    def _message(self) -> str:
        lines = [str(e) for e in self.errors]
        if len(lines) > 1:
            lines[0] += f" ({len(lines)} errors, one per line)"
        return "\n".join(lines)

    def __reduce__(self):
        return (ConfigErrors, (self.errors,))


def raise_all(errors: list[ConfigError]) -> None:
    """Raise the errors found (one as itself, several as `ConfigErrors`); nothing if none."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


def suggest(name: str, candidates: list[str], prefix: str = "") -> str | None:
    """A "did you mean ...?" hint for a misspelt key, or the list of valid keys."""
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if matches:
        return f"did you mean {prefix}{matches[0]}?"
    if len(candidates) <= 12:
        return "valid keys: " + ", ".join(candidates)
    return None


def yaml_error_to_config_error(err: yaml.YAMLError, path: str) -> ConfigError:
    """Convert a PyYAML error into a ConfigError naming the file, line and column."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return ConfigError(
        "--config", str(path), f"malformed YAML{where}: {problem}", "fix the YAML syntax there"
    )


def first_report_on_node(message: str) -> bool:
    """Whether this process should print `message`: outside torchrun always; under torchrun the
    first rank of its node to report it (a marker file per torchrun agent and message), so an
    error found by any rank is printed once per node, however torchrun then kills the others."""
    if "RANK" not in os.environ:
        return True
    digest = hashlib.sha1(message.encode()).hexdigest()[:16]
    marker = Path(tempfile.gettempdir()) / f"megatron_async_rl-{os.getppid()}-{digest}.reported"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return os.environ.get("RANK") == "0"  # no writable temp dir: rank 0 alone, as before
    return True


def reported_on_node() -> bool:
    """Whether a rank of this torchrun agent has reported an error (`first_report_on_node`):
    then a peer's failure that follows (a collective cut by the exiting rank) is its echo."""
    if "RANK" not in os.environ:
        return False
    return any(Path(tempfile.gettempdir()).glob(f"megatron_async_rl-{os.getppid()}-*.reported"))


def exit_on_config_error(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call `fn`; on a ConfigError (or a YAML error) print one `error:` line and exit with 2."""
    try:
        return fn(*args, **kwargs)
    except ConfigError as err:
        message = str(err)
    except yaml.YAMLError as err:
        message = str(yaml_error_to_config_error(err, "<yaml>"))
    # Under torchrun every rank resolves the same recipe: one message per node is enough.
    if first_report_on_node(message):
        sys.stderr.write("".join(f"error: {line}\n" for line in message.splitlines()))
        sys.stderr.flush()
    sys.exit(2)


@functools.cache
def warn_once(message: str) -> None:
    """Log `message` as a warning the first time it is given in this process."""
    logger.warning(message)
