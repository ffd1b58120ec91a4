"""Known dependency noise is filtered in one place (`observability.quiet`), and only that.

Contract: on a CPU machine `quiet_known_noise` silences exactly the listed warnings in this
process and hands the same filters to child processes through PYTHONWARNINGS (SGLang's engine
processes); a warning that is not listed still shows; on a GPU machine the CPU-only entries
(a missing Transformer Engine) still show; MEGATRON_ASYNC_RL_VERBOSE=1 filters nothing.
Each entry says why it is noise. Runs in a child interpreter, so this process's filters stay.
"""

import os
import subprocess
import sys

from megatron_async_rl.observability.quiet import KNOWN_NOISE, KNOWN_NOISE_BY_MODULE


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    full.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def _shown(on_cpu: bool, **env) -> str:
    code = (
        "import warnings\n"
        "from megatron_async_rl.observability.quiet import KNOWN_NOISE, quiet_known_noise\n"
        f"quiet_known_noise(on_cpu={on_cpu})\n"
        "for message, category, _, _ in KNOWN_NOISE:\n"
        "    warnings.warn(message + ' (probe)', category)\n"
        "from megatron_async_rl.observability.quiet import KNOWN_NOISE_BY_MODULE\n"
        "for module, category, _ in KNOWN_NOISE_BY_MODULE:\n"
        "    warnings.warn_explicit(module + ': by module (probe)', category, 'x.py', 1, module)\n"
        "warnings.warn_explicit('other module (probe)', UserWarning, 'x.py', 1, 'some.module')\n"
        "warnings.warn('something about the user run', UserWarning)\n"
        "import os; print(os.environ.get('PYTHONWARNINGS', ''))\n"
    )
    proc = _run(code, **env)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr + proc.stdout


def test_cpu_filters_exactly_the_listed_noise():
    out = _shown(on_cpu=True)
    assert "something about the user run" in out
    for message, category, _, why in KNOWN_NOISE:
        assert why
        assert f"{message} (probe)" not in out
        assert f"ignore:{message}:{category.__name__}" in out  # for the engine processes
    for module, category, why in KNOWN_NOISE_BY_MODULE:
        assert why and f"{module}: by module (probe)" not in out
        assert f"ignore::{category.__name__}:{module}" in out
    assert "other module (probe)" in out


def test_gpu_keeps_the_cpu_only_entries_and_verbose_keeps_all():
    out = _shown(on_cpu=False)
    assert "Transformer Engine and Apex are not installed (probe)" in out
    assert "`load_state_dict` is deprecated (probe)" not in out
    verbose = _shown(on_cpu=True, MEGATRON_ASYNC_RL_VERBOSE="1")
    assert all(f"{message} (probe)" in verbose for message, *_ in KNOWN_NOISE)
    assert all(f"{module}: by module (probe)" in verbose for module, *_ in KNOWN_NOISE_BY_MODULE)
