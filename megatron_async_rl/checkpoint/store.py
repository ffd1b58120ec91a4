"""Checkpoint directories on disk: atomic publication, a manifest written last, verification.

Owned here (files only: no torch.distributed, no megatron): the names of a checkpoint's
directories, `Manifest`, `publish` (checksums every file of a staged directory, writes the
manifest last and renames the directory into place), `verify`, `find_resumable` (the newest
complete checkpoint, skipping bad ones with one warning line each), `prune` (keep the newest
`keep_last`) and `recipe_hash` / `check_compatible`. Called by `checkpoint.manager` on the
leader rank.

On disk, under the checkpoint directory:
    step_00000012/                 complete (published by a rename)
        megatron/                  the train role's model and optimizer (dist_checkpointing)
        rank_00000.pt ...          each rank's pipeline state (`checkpoint.pipeline_state`)
        manifest.json              last: step, version, world size, recipe hash, every file's
                                   size and XXH3-64 checksum
    .partial_step_00000014/        being written (ignored by resume; removed by the next save)
A checkpoint is complete when its manifest exists and every file it lists has its size and
checksum; anything else is skipped with a warning naming what is wrong, and the previous one
used. The directory must be shared by every node (a cluster file system).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import xxhash

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{8})$")
_CHUNK = 16 << 20


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def partial_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f".partial_step_{step:08d}"


@dataclasses.dataclass
class Manifest:
    step: int
    """Optimizer steps done (the policy version the checkpoint holds)."""
    world_size: int
    recipe_hash: str
    recipe_keys: dict[str, Any]
    """The recipe values that must match to resume (`compatibility_keys`)."""
    files: dict[str, list[int]]
    """Path relative to the checkpoint -> [size in bytes, XXH3-64 checksum]."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        return cls(**json.loads(text))


def file_checksum(path: Path) -> int:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.intdigest()


def _listing(root: Path) -> dict[str, list[int]]:
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        out[str(path.relative_to(root))] = [path.stat().st_size, file_checksum(path)]
    return out


def _fsync_tree(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(root: str | Path, step: int, manifest: Manifest) -> Path:
    """Checksum every file of the staged `.partial_step_N`, write its manifest last (fsynced)
    and rename it to `step_N` (atomic on one file system). Returns the published path."""
    staged, final = partial_dir(root, step), step_dir(root, step)
    manifest.files = _listing(staged)
    tmp = staged / (MANIFEST + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, staged / MANIFEST)
    _fsync_tree(staged)
    if final.exists():  # a re-save of the same step (e.g. a signal right after a save)
        shutil.rmtree(final)
    os.replace(staged, final)
    _fsync_tree(Path(root))
    return final


def verify(path: Path) -> tuple[Manifest | None, str | None]:
    """(manifest, None) if the checkpoint at `path` is complete, else (None, what is wrong)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return None, "no manifest.json (incomplete: written last)"
    try:
        manifest = Manifest.from_json(manifest_path.read_text())
    except (ValueError, TypeError) as err:
        return None, f"manifest.json unreadable: {err}"
    for name, (size, checksum) in manifest.files.items():
        file = path / name
        if not file.is_file():
            return None, f"{name} is missing"
        if file.stat().st_size != size:
            return None, f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
        if file_checksum(file) != checksum:
            return None, f"{name} fails its checksum (corrupt)"
    return manifest, None


def checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Published checkpoints under `root`, (step, path), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name))]
    return sorted(found)


def find_resumable(root: str | Path) -> tuple[Path, Manifest] | None:
    """The newest complete checkpoint under `root` (a bad one: one warning, then the one before)."""
    for _, path in reversed(checkpoints(root)):
        manifest, problem = verify(path)
        if manifest is not None:
            return path, manifest
        logger.warning("checkpoint %s skipped: %s; trying the previous one", path, problem)
    return None


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` published checkpoints, and stale partial ones."""
    removed = []
    published = checkpoints(root)
    for _, path in published[: max(0, len(published) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_partials(root: str | Path) -> None:
    root = Path(root)
    if root.is_dir():
        for path in root.glob(".partial_step_*"):
            shutil.rmtree(path, ignore_errors=True)


def compatibility_keys(cfg) -> dict[str, Any]:
    """What a resumed run must share with the saved one: the model (its architecture from the
    train role's Megatron args), the algorithm, and each trained role's optimizer format (its
    state loads only into the format that saved it). Layout, rank count, schedule and paths may
    differ."""
    args = cfg.role_megatron_args.get("train") or {}
    arch = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
            "num_query_groups", "kv_channels", "num_experts", "vocab_size", "swiglu",
            "normalization", "untie_embeddings_and_output_weights", "bf16", "fp16")  # fmt: skip
    out = {f"megatron.{k}": args.get(k) for k in arch}
    for role in ("train", "critic"):  # the optimizer state loads only into its own format
        if role in cfg.role_megatron_args:
            out[f"{role}.optimizer_format"] = _optimizer_format(cfg.role_megatron_args[role])
    out.update({f"algorithm.{k}": v for k, v in dataclasses.asdict(cfg.algorithm).items()})
    out["seed"] = cfg.seed
    return json.loads(json.dumps(out, default=str))


def _optimizer_format(args: dict[str, Any]) -> str:
    """How a trained role's optimizer state is checkpointed: "distributed" (megatron-core's
    distributed optimizer, --use-distributed-optimizer) or "torch" (torch's optimizer state in
    model space: DDP without it, or --use-torch-fsdp2). One does not load from the other."""
    return "distributed" if args.get("use_distributed_optimizer") else "torch"


# Keys added to the manifest after checkpoints were written without them: compared only when
# the saved manifest has them.
_ADDED_LATER = ("train.optimizer_format", "critic.optimizer_format")


def recipe_hash(keys: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def differing_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Keys whose values differ; a key the saved manifest lacks (an `algorithm:` knob added
    after it was written) counts as its default, which is what that run used."""
    from megatron_async_rl.algorithms.config import GRPOConfig

    defaults = json.loads(json.dumps(
        {f"algorithm.{k}": v for k, v in dataclasses.asdict(GRPOConfig()).items()}, default=str
    ))  # fmt: skip
    missing = object()

    def was(key):
        value = saved.get(key, missing)
        return defaults.get(key) if value is missing else value

    keys = saved.keys() | current.keys()
    keys -= {k for k in _ADDED_LATER if k not in saved}
    return sorted(k for k in keys if was(k) != current.get(k))


def check_resume_matches(cfg) -> None:
    """The launcher's dry run: raise `ConfigError` when the checkpoint the run would resume
    from (`checkpoint.resume`) was saved by a recipe whose model or algorithm differs. Reads
    manifests only (the run itself verifies checksums)."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return
    candidates = [Path(resume)] if resume != "auto" else [
        p for _, p in reversed(checkpoints(cfg.checkpoint.path(cfg.run_dir)))
    ]  # fmt: skip
    for path in candidates:
        try:
            manifest = Manifest.from_json((path / MANIFEST).read_text())
        except (OSError, ValueError, TypeError):
            continue  # incomplete or unreadable: the run skips it with a warning
        check_same_recipe(path, manifest.recipe_keys, compatibility_keys(cfg))
        return


def check_same_recipe(path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise `ConfigError` naming the keys where the recipe that saved `path` differs."""
    from megatron_async_rl.config.errors import ConfigError

    differing = differing_keys(saved, current)
    if differing:
        what = ", ".join(
            f"{k} (saved {saved.get(k)!r}, now {current.get(k)!r})" for k in differing
        )
        raise ConfigError(
            "--resume", str(path),
            f"the checkpoint was saved by a recipe that differs in {what}",
            hint="resume with the recipe that saved it, or --resume never",
        )  # fmt: skip
