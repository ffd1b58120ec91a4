"""The wheels the GPU test machine needs to run SGLang's engine, computed and downloaded here.

    .venv/bin/python scripts/gpu_bundle.py [--out .whl] [--limit-mib 64] [--also NAME==VERSION]

(`scripts/gpu_bundle.sh` runs it with the CPU venv.) The GPU machine has Python 3.12, torch with
CUDA and triton, no SGLang and no network; what a run there needs travels with the repository,
at most `--limit-mib` in all. The list is computed, not written by hand:

1. **What the engine imports**: a tiny model is written and one SGLang engine is started on CPU
   and asked for a few tokens (`engines.sglang.engine.SGLangEngine`, the project's own path),
   with `PYTHONPROFILEIMPORTTIME` set, so every process of it (host, scheduler, detokenizer)
   reports each module it imports; the top-level modules map to their distributions
   (`importlib.metadata.packages_distributions`).
2. **Less what the GPU image has** (`scripts/gpu_image_packages.txt`, its documented list), the
   kernel and CUDA packages that stay behind (`KERNELS`: sgl-kernel, flashinfer, torch, triton,
   nvidia-*: the engine runs its torch and triton paths there) and this project (it travels as
   the working tree).
3. **Plus what the GPU checks pin** (`PINNED`: megatron-core at the top of the supported range,
   transformers and tokenizers at constraints/cpu.txt's versions), each at this venv's version
   or the pinned one.
4. **Less what it imports but serves without** (`optional`: `try: import wandb` in
   megatron-core, zstandard in httpx): each wheel above `--optional-above-mib` is hidden from
   a second engine run (a meta-path hook in every process), and given back when a run fails
   for it, until one serves.

Each is downloaded as a cp312 manylinux (or pure-Python) wheel, without dependencies, into
`--cache`; they are unpacked as `pip install --target` lays them out and written as one xz tar,
`--out`/site.tar.xz (git-ignored `.whl/`; `scripts/gpu_checks.sh` unpacks it into /tmp/site):
about 0.6 of the wheels' bytes, deflate compressing each file alone. Last, the archive and the
repository's tracked files are checked against the limit. Output: one line per wheel (name,
version, MiB, why carried or left), then `RESULT bundle_mib=<archive> tree_mib=<tracked files>
total_mib=<both> limit_mib=<limit> ok=<bool>`; exit 1 when over the limit or a wheel cannot be
had.

An engine on CPU imports some modules a CUDA engine does not, and the reverse (the CUDA paths'
imports are only known on a GPU): `scripts/gpu_checks.sh` reports an import that fails there,
and `--also NAME==VERSION` adds a distribution by hand for that case.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGE_LIST = REPO / "scripts" / "gpu_image_packages.txt"
CONSTRAINTS = REPO / "constraints" / "cpu.txt"
KERNELS = ("torch", "triton", "sgl-kernel", "sglang-kernel", "flashinfer-python",
           "flashinfer-cubin", "flash-attn-4", "cuda-python", "torch-memory-saver",
           "megatron-async-rl")  # fmt: skip
"""Never carried: kernels and CUDA runtimes (the image has its own torch and triton; SGLang runs
its torch and triton paths without sgl-kernel), and this project (the working tree)."""
KERNEL_PREFIXES = ("nvidia-", "cuda-")
PINNED = {"megatron-core": "0.19.2", "transformers": None, "tokenizers": None}
"""Carried whatever the image has, for the GPU checks (None: constraints/cpu.txt's version)."""
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux1_x86_64")  # fmt: skip

_TRACE = r"""
import os
import sys
from pathlib import Path

HIDDEN = set(filter(None, os.environ.get("GPU_BUNDLE_HIDE", "").split(",")))


class Hide:  # as if those distributions were not installed: in this process and its children
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in HIDDEN:
            print(f"gpu_bundle: hid {top}", file=sys.stderr, flush=True)
            raise ModuleNotFoundError(f"No module named {top!r} (hidden)", name=top)
        return None


sys.meta_path.insert(0, Hide())


def main(tmp):
    from megatron_async_rl.engines.config import SGLangEngineConfig
    from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams
    from megatron_async_rl.engines.sglang.engine import SGLangEngine
    from megatron_async_rl.models.tiny import write_tiny_model

    model = write_tiny_model(Path(tmp) / "model", family="llama", seed=0)
    config = SGLangEngineConfig(model_path=str(model), dtype="float32", max_total_tokens=2048,
                                startup_timeout_s=600)
    engine = SGLangEngine(config, rank_in_role=0, global_rank=0)
    try:
        request = GenerateRequest([1, 5, 6, 7], SamplingParams(max_new_tokens=4), "a")
        print("generated", len(engine.generate([request])[0].output_ids), file=sys.stderr)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run_engine(python: str, hide: set[str] = frozenset()) -> tuple[bool, str]:
    """(served, stderr) of an SGLang engine started on CPU and asked for 4 tokens, with every
    process reporting its imports, and the top-level modules `hide` not importable."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "trace_engine.py"  # a file: the spawned engine host imports it
        script.write_text(_TRACE)
        env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1", PYTHONPATH=str(REPO),
                   GPU_BUNDLE_HIDE=",".join(sorted(hide)))  # fmt: skip
        proc = subprocess.run([python, str(script), tmp], env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
    # an engine that died starting (a hidden import) leaves its segments: the next start
    # would sweep them, this script may not start another
    from megatron_async_rl.engines.sglang.shm_sweep import remove_stale_segments

    remove_stale_segments()
    return proc.returncode == 0 and "generated" in proc.stderr, proc.stderr


def imported_modules(python: str) -> set[str]:
    """Top-level modules imported by an SGLang engine's processes started on CPU."""
    served, stderr = run_engine(python)
    if not served:
        tail = "\n".join(line for line in stderr.splitlines()
                         if not line.startswith("import time:"))[-3000:]  # fmt: skip
        raise SystemExit(f"gpu_bundle: the tracing engine failed:\n{tail}")
    return _modules(stderr)


def _modules(stderr: str) -> set[str]:
    modules = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "self [us]" not in line:
            name = line.rsplit("|", 1)[1].strip()
            if name:
                modules.add(name.split(".")[0])
    return modules


def distributions(modules: set[str]) -> dict[str, set[str]]:
    """{distribution name as installed: its top-level modules among `modules`}."""
    owners = md.packages_distributions()
    found: dict[str, set[str]] = {}
    for module in modules - set(sys.stdlib_module_names):
        for dist in owners.get(module, ()):
            found.setdefault(dist, set()).add(module)
    return found


def optional(python: str, candidates: dict[str, set[str]], max_runs: int = 20) -> set[str]:
    """The distributions of `candidates` ({name: its top-level modules}) the engine serves
    without: all hidden at once, then each one whose absence a run fails on is given back
    (named in its `No module named`), until a run serves. Imports that are optional
    (`try: import wandb`) are why the trace names more than the engine needs."""
    hidden = set(candidates)
    for _ in range(max_runs):
        modules = {m for name in hidden for m in candidates[name]}
        served, stderr = run_engine(python, modules)
        if served:
            return hidden
        missing = set(re.findall(r"No module named '([\w]+)' \(hidden\)", stderr))
        back = {name for name in hidden if candidates[name] & missing}
        if not back:  # a failure not attributed to one of them: keep them all
            return set()
        print(f"needed: {', '.join(sorted(back))}", flush=True)
        hidden -= back
    return set()


def image_packages() -> set[str]:
    lines = IMAGE_LIST.read_text().splitlines()
    return {norm(line) for line in lines if line.strip() and not line.startswith("#")}


def constraint(name: str) -> str:
    for line in CONSTRAINTS.read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise SystemExit(f"gpu_bundle: {CONSTRAINTS} has no '{name}==<version>' line")


def plan(found: dict[str, set[str]], image: set[str],
         also: list[str]) -> dict[str, tuple[str, str]]:  # fmt: skip
    """{name: (version, why)} of the wheels to carry."""
    wanted = {}
    for dist in sorted(found):
        key = norm(dist)
        if key in KERNELS or key.startswith(KERNEL_PREFIXES) or key in image:
            continue
        wanted[dist] = (md.version(dist), "imported by the engine, not in the image")
    for name, version in PINNED.items():
        wanted[name] = (version or constraint(name), "pinned for the GPU checks")
    for item in also:
        name, _, version = item.partition("==")
        if not version:
            raise SystemExit(f"gpu_bundle: --also {item!r}: must be NAME==VERSION")
        wanted[name] = (version, "--also")
    return wanted


def download(name: str, version: str, out: Path) -> Path:
    """The cp312 linux wheel of name==version in `out` (downloaded unless there already)."""
    key = norm(name).replace("-", "_")
    for wheel in out.glob("*.whl"):
        if norm(wheel.name.split("-")[0]).replace("-", "_") == key and f"-{version}-" in wheel.name:
            return wheel
    before = set(out.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
           "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
           "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(out)]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    proc = subprocess.run([*cmd, f"{name}=={version}"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_bundle: no cp312 linux wheel of {name}=={version}:\n"
                         f"{proc.stderr[-1500:]}")  # fmt: skip
    new = set(out.iterdir()) - before
    if new:
        return new.pop()
    raise SystemExit(f"gpu_bundle: pip reported {name}=={version} but wrote no wheel")


def tracked_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.split(b"\0")  # fmt: skip
    paths = [REPO / n.decode() for n in names if n]
    return sum(p.stat().st_size for p in paths if p.is_file())


def pack(wheels: list[Path], archive: Path) -> None:
    """The wheels unpacked as `pip install --target` lays them out (a wheel's `.data/purelib`
    and `platlib` into the root), in one xz tar: deflate compresses each file of a wheel alone,
    xz the whole tree at once (about 0.6 of the wheels' size)."""
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zipped:
                zipped.extractall(site)
        for data in site.glob("*.data"):
            for part in ("purelib", "platlib"):
                if (data / part).is_dir():
                    shutil.copytree(data / part, site, dirs_exist_ok=True)
            shutil.rmtree(data)
        with tarfile.open(archive, "w:xz", preset=6) as tar:
            tar.add(site, arcname=".")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / ".whl"))
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "megatron_async_rl" /
                                                "gpu-wheels"))  # fmt: skip
    parser.add_argument("--limit-mib", type=float, default=64.0)
    parser.add_argument("--also", action="append", default=[], metavar="NAME==VERSION")
    parser.add_argument("--optional-above-mib", type=float, default=0.25,
                        help="wheels above this size are tried without (optional imports)")
    args = parser.parse_args(argv)
    out, cache = Path(args.out), Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    modules = imported_modules(sys.executable)
    found = distributions(modules)
    wanted = plan(found, image_packages(), args.also)
    wheels = {name: download(name, version, cache) for name, (version, _) in wanted.items()}
    big = {name: found[name] for name in wanted
           if name in found and norm(name) != "sglang" and name not in PINNED
           and wheels[name].stat().st_size > args.optional_above_mib * 2**20}  # fmt: skip
    dropped = optional(sys.executable, big)
    total = 0
    for name in sorted(wanted, key=lambda n: -wheels[n].stat().st_size):
        version, why = wanted[name]
        size = wheels[name].stat().st_size
        if name in dropped:
            why = "left behind: the engine serves without it (an optional import)"
        else:
            total += size
        print(f"{name:30s} {version:16s} {size / 2**20:7.2f} MiB  {why}")
    for old in out.iterdir():  # what an earlier bundle left
        old.unlink()
    archive = out / "site.tar.xz"
    pack([wheels[n] for n in wanted if n not in dropped], archive)
    packed, tree = archive.stat().st_size, tracked_bytes()
    ok = (packed + tree) / 2**20 <= args.limit_mib
    print(f"{len(wanted) - len(dropped)} wheels ({total / 2**20:.1f} MiB) packed into {archive}; "
          f"{len(modules)} top-level modules imported by the engine")  # fmt: skip
    print(f"RESULT bundle_mib={packed / 2**20:.1f} tree_mib={tree / 2**20:.1f} "
          f"total_mib={(packed + tree) / 2**20:.1f} limit_mib={args.limit_mib:g} "
          f"ok={str(ok).lower()}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
