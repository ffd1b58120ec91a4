"""What one rank of each role holds, in bytes, from the recipe alone (pure; for `--dry-run`).

Owned here: `plan_memory(cfg, layout)` -> one `RankMemory` per role, for that role's busiest
rank (the pipeline stage and expert shard with the most weights), and `describe`. Counted:
- device: the rank's weights (its pipeline stage, its experts, its TP/expert-TP slice, vocab
  padding ignored) in the role's dtype; for `train` also the gradient buffer (fp32 when
  `grad_reduce_in_fp32` or not bf16/fp16, else the param dtype) and Adam's state: an fp32 main
  copy when training in bf16/fp16, plus two fp32 moments, divided over data-parallel ranks
  with `use_distributed_optimizer`. Activations, the KV cache and allocator slack are not
  counted (they depend on batch and sequence shapes); an engine host holds its engine's share
  of the model plus SGLang's KV pool (`mem_fraction_static` of its GPUs).
- host: reading the checkpoint (the rank's weights, in the checkpoint's dtype, built before
  they move to the device) and, on asynchronous generate ranks, the weight-sync staging arena:
  the whole model in the train dtype, in shared memory (/dev/shm: the engine's processes map
  it; pinned for the GPU's copies). `check_shared_memory` refuses to start an engine host
  whose /dev/shm cannot hold it. A logp rank stages nothing whole: it copies the pieces its
  slices come from into its parameters as they arrive (`weight_sync.shard_sink`), a few
  tensors at a time. With `weight_sync.delta`, the delta bases (`weight_sync.delta_wire`): a
  train rank that sends keeps its messages (its pipeline stage, whole over TP, in the train
  dtype), a logp or generate rank the whole model in the train dtype.
"""

from __future__ import annotations

import dataclasses
import math
import shutil

from megatron_async_rl.config.errors import ConfigError
from megatron_async_rl.config.roles import TRAINED_ROLES
from megatron_async_rl.models.dims import ModelDims, hf_shape
from megatron_async_rl.models.names import hf_names_for, shard_spec, stage_param_names

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class RankMemory:
    role: str
    ranks: range
    device: dict[str, int]
    host: dict[str, int]

    def line(self) -> str:
        dev = " + ".join(f"{k} {v / GiB:.1f}" for k, v in self.device.items() if v)
        host = " + ".join(f"{k} {v / GiB:.1f}" for k, v in self.host.items() if v)
        return (f"  {self.role:<9} ranks {self.ranks.start}-{self.ranks.stop - 1}: device "
                f"{sum(self.device.values()) / GiB:.1f} GiB ({dev}); host "
                f"{sum(self.host.values()) / GiB:.1f} GiB ({host})")  # fmt: skip


def _dtype_bytes(args: dict) -> int:
    return 2 if args.get("bf16") or args.get("fp16") else 4


def _param_numel(name: str, dims: ModelDims) -> int:
    return sum(math.prod(hf_shape(hf, dims)) for hf in hf_names_for(name, dims))


def stage_numel(dims: ModelDims, grid) -> int:
    """Weights on the busiest rank of a role grid (after TP / expert-TP slicing)."""
    best = 0
    for pp_rank in range(grid.pp):
        for ep_rank in range(grid.ep):
            names = stage_param_names(dims, pp_rank=pp_rank, pp_size=grid.pp,
                                         ep_rank=ep_rank, ep_size=grid.ep)  # fmt: skip
            n = 0
            for name in names:
                spec = shard_spec(name, dims)
                split = 1 if spec.partition_dim is None else grid.etp if spec.is_expert else grid.tp
                n += _param_numel(name, dims) // split
            best = max(best, n)
    return best


def model_numel(dims: ModelDims) -> int:
    return sum(_param_numel(name, dims) for name in stage_param_names(dims))


def plan_memory(cfg, layout) -> list[RankMemory]:
    """One `RankMemory` per placed role (Megatron roles and generate)."""
    out = []
    train_args = cfg.role_megatron_args.get("train") or next(iter(cfg.role_megatron_args.values()))
    if train_args.get("vocab_size") is None:
        from megatron_async_rl.config.errors import ConfigError

        raise ConfigError(
            "--vocab-size", None,
            "is unknown, so memory cannot be planned: Megatron-LM reads it from its tokenizer; "
            "this trainer from model.hf_path's config.json",
            "set model.hf_path, or --vocab-size / megatron.vocab_size",
        )  # fmt: skip
    dims = ModelDims.from_megatron_args(train_args)
    whole = model_numel(dims)
    for role, args in cfg.role_megatron_args.items():
        if role not in layout.parallelism:
            continue
        grid, b = layout.grid(role), _dtype_bytes(args)
        # a critic or reward model has its own checkpoint's size (its head ~ the LM head's)
        n = stage_numel(ModelDims.from_megatron_args(args), grid)
        device = {"weights": n * b}
        if role in TRAINED_ROLES:
            low = bool(args.get("bf16") or args.get("fp16"))
            grad = 4 if args.get("grad_reduce_in_fp32") or not low else b
            state = n * ((4 if low else 0) + 8)
            if args.get("use_distributed_optimizer"):
                state //= grid.dp
            device.update(grads=n * grad, optimizer=state)
        host = {"checkpoint read": n * b}
        delta = getattr(cfg, "weight_sync", None) is not None and cfg.weight_sync.delta
        if delta and role == "train":
            host["delta bases"] = whole * b // grid.pp
        elif delta and role == "logp":
            host["delta bases"] = whole * _dtype_bytes(train_args)
        out.append(RankMemory(role, grid.ranks, device, host))
    if "generate" in {r for w in layout.windows for r in w.roles}:
        window = layout.window_of("generate")
        tp = cfg.engine.tp_size
        engine_b = 4 if cfg.engine.dtype == "float32" else 2  # auto: a bf16 checkpoint
        host = {"sync staging": staging_bytes(cfg)}
        if getattr(cfg, "weight_sync", None) is not None and cfg.weight_sync.delta:
            host["delta bases"] = whole * _dtype_bytes(train_args)
        ranks = range(window.ranks[0], window.ranks[-1] + 1)
        out.append(RankMemory("generate", ranks, {"engine weights": whole * engine_b // tp}, host))
    return out


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 10 else f"{nbytes / 2**20:.1f} MiB"


def saved(cfg, layout) -> list[str]:
    """What the run does not hold because it does not place a role it needs no pass of
    (`algorithms.passes`): the forward-only logp and ref roles, each sized as a copy of the
    train role's weights on its busiest rank."""
    placed = cfg.roles.placed_roles()
    args = cfg.role_megatron_args["train"]  # train is placed in every recipe
    per_rank = stage_numel(ModelDims.from_megatron_args(args), layout.grid("train")) \
        * _dtype_bytes(args)  # fmt: skip
    why = {"ref": "no KL term", "logp": f"old log-probs from the {cfg.algorithm.old_logprobs}"}
    return [
        f"  {role}: not placed ({why[role]}): {_size(per_rank)} of weights per rank not held "
        f"(sized as train's), and no {role} forward pass per step"
        for role in ("logp", "ref") if role not in placed
    ]  # fmt: skip


def staging_bytes(cfg) -> int:
    """Shared memory an engine host stages weights in: the whole model in the train dtype on
    the asynchronous loop (received while generation runs), none on the synchronous one (it
    streams each message into the engine)."""
    if not cfg.scheduler.use_async_loop:
        return 0
    args = cfg.role_megatron_args.get("train") or next(iter(cfg.role_megatron_args.values()))
    return model_numel(ModelDims.from_megatron_args(args)) * _dtype_bytes(args)


def check_shared_memory(need: int, path: str = "/dev/shm") -> None:
    """Raise `ConfigError` when `path` has less than `need` bytes free (startup, before the
    engine: a full /dev/shm is otherwise a SIGBUS in the middle of a weight sync)."""
    free = shutil.disk_usage(path).free
    if need > free:
        raise ConfigError(
            "scheduler.use_async_loop", True,
            f"this engine host stages the whole model ({need / GiB:.2f} GiB in the train "
            f"dtype) in shared memory for each weight sync, but {path} has "
            f"{free / GiB:.2f} GiB free",
            hint="enlarge it (docker run --shm-size, a bigger tmpfs on /dev/shm, SLURM's "
            "job shared-memory limit) or run the synchronous loop",
            rank_local=True,
        )  # fmt: skip


def describe(plans: list[RankMemory], engine_fraction: float | None = None,
             saved_lines: list[str] = ()) -> str:  # fmt: skip
    lines = ["memory per rank (busiest rank of each role; activations and KV cache not counted):"]
    lines += [p.line() for p in plans]
    if engine_fraction is not None:
        lines.append(f"  generate: plus SGLang's KV pool, mem_fraction_static={engine_fraction} "
                     "of each engine GPU")  # fmt: skip
    lines += saved_lines
    return "\n".join(lines)
