"""Package definition. GPU-only dependencies are extras, detected at run time, never required."""

from setuptools import find_packages, setup

setup(
    name="megatron_async_rl",
    version="0.1.0",
    description="Asynchronous RL for LLMs on Megatron-core roles with embedded SGLang engines",
    packages=find_packages(include=["megatron_async_rl", "megatron_async_rl.*"]),
    # Import shims for SGLang's engine processes (engines/sglang/cpu_shims/README.md, and
    # kernel_free_shims/ for CUDA without sgl-kernel): plain folders on the engine's PYTHONPATH,
    # not packages of ours.
    package_data={
        "megatron_async_rl.config.megatron": ["megatron_lm_flags/*.json"],
        "megatron_async_rl.engines.sglang": [
            "cpu_shims/*",
            "cpu_shims/*/*",
            "cpu_shims/*/*/*",
            "cpu_shims/*/*/*/*",
            "kernel_free_shims/*",
            "kernel_free_shims/*/*",
        ]
    },
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        # Ranges, not pins: this is a plugin that lives in its users' environment. Both ends of
        # the megatron-core range are tested (scripts/test.sh); the exact versions installed
        # here are in constraints/cpu.txt.
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        "einops>=0.8",
        "matplotlib>=3.7",
        # the `math` reward's equivalence checks (rewards/math_grade.py)
        "math-verify>=0.9,<0.10",
        "numpy",
        "packaging",
        "pyarrow",
        "pyyaml>=6",
        "safetensors>=0.4",
        # what the supported SGLang releases (0.5.21 to 0.5.23) pin, each its own version
        "transformers>=5.12.1,<6",
        "tokenizers>=0.22.2,<0.24",
        "tqdm",
        # weight-sync message checksums (XXH3: ~6x faster than CRC-32 here)
        "xxhash>=3",
        # weight-sync deltas (weight_sync/delta.py); SGLang installs it too
        "zstandard>=0.22",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout>=2.3", "ruff>=0.6", "tensorboard", "psutil",
                 "wandb>=0.22",
                 # the documentation build (tests/unit/test_docs.py runs sphinx-build)
                 "sphinx>=8,<10", "myst-parser>=4,<6"],
        "wandb": ["wandb>=0.22"],
        "gpu": ["transformer-engine[pytorch]>=2.9", "apex"],
        "tensorboard": ["tensorboard"],
    },
    entry_points={
        "console_scripts": [
            "megatron-async-rl-tiny-model=megatron_async_rl.models.tiny:main",
        ]
    },
)
