"""`scripts/gpu_bundle.py`'s planning: what an engine's import trace turns into wheels to carry.

Contracts: the import-time lines of every process give top-level modules; distributions the GPU
image lists, kernels and CUDA packages (torch, triton, sgl-kernel, flashinfer, nvidia-*) and this
project are never carried; the pinned ones always are, at constraints/cpu.txt's versions; a
hand-added one needs NAME==VERSION. The real trace, downloads and size check run in the script
(`bash scripts/gpu_bundle.sh`, measured in the note).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bundle.py"
spec = importlib.util.spec_from_file_location("gpu_bundle", SCRIPT)
bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bundle)


def test_import_lines_give_top_level_modules():
    stderr = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       362 |        990 |                       zstandard.backend_c",
        "import time:      1476 |     407347 |             sglang.srt.utils",
        "engine log line | with a bar",
    ])  # fmt: skip
    assert bundle._modules(stderr) == {"zstandard", "sglang"}


def test_the_plan_leaves_kernels_and_the_image_behind():
    found = {"sglang": {"sglang"}, "torch": {"torch"}, "triton": {"triton"},
             "sglang-kernel": {"sgl_kernel"}, "flashinfer_python": {"flashinfer"},
             "nvidia-cublas": {"nvidia"}, "numpy": {"numpy"}, "orjson": {"orjson"},
             "megatron_async_rl": {"megatron_async_rl"}}  # fmt: skip
    image = bundle.image_packages()
    assert "numpy" in image and "orjson" not in image and "sglang" not in image
    wanted = bundle.plan(found, image, ["extra-pkg==1.2"])
    carried = {bundle.norm(n) for n in wanted}
    assert carried == {"sglang", "orjson", "megatron-core", "transformers", "tokenizers",
                       "extra-pkg"}
    assert wanted["transformers"][0] == bundle.constraint("transformers")
    assert wanted["extra-pkg"] == ("1.2", "--also")


def test_a_hand_added_wheel_needs_a_version():
    with pytest.raises(SystemExit, match="--also 'extra-pkg': must be NAME==VERSION"):
        bundle.plan({}, set(), ["extra-pkg"])
