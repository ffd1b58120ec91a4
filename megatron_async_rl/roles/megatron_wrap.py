"""A trained Megatron role's wrap, optimizer and schedule hooks.

Owned here: `wrap_for_training`, called by `roles.megatron_role.MegatronRole` for a role in
`TRAINED_ROLES` (the actor, PPO's critic): its chunks in megatron-core's
`DistributedDataParallel` (or FSDP2's wrapper with --use-torch-fsdp2, `models.torch_fsdp2`),
Megatron's optimizer built over the role's own groups (`role_scoped_object_gather`), its lr
schedule (`roles.lr_schedule`), its param-group map written with
--dump-param-to-param-group-map (`roles.param_groups`), and the hooks megatron-core's schedule
calls on the role's config. `role` is the `MegatronRole` being built (not imported here: that
module imports this one).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from megatron_async_rl.compat import megatron_fixes
from megatron_async_rl.config.errors import warn_once
from megatron_async_rl.config.megatron import core_kwargs
from megatron_async_rl.models import torch_fsdp2
from megatron_async_rl.roles import lr_schedule, param_groups


@contextlib.contextmanager
def role_scoped_object_gather(group):
    """Scope Megatron's world-wide `all_gather_object` to the role while building an optimizer.

    `get_megatron_optimizer` gathers its param-group keys over the WORLD (facts: leak 3); if only
    some roles build an optimizer the world hangs. Inside this block a group-less call gathers
    over `group` instead. Main thread only; the original is restored on exit.
    """
    original = dist.all_gather_object

    def gather(object_list, obj, group_=None, **kwargs):
        if group_ is None and "group" not in kwargs:
            gathered = [None] * dist.get_world_size(group)
            original(gathered, obj, group=group)
            object_list[:] = gathered
            return None
        return original(object_list, obj, group=kwargs.pop("group", group_), **kwargs)

    dist.all_gather_object = gather
    try:
        yield
    finally:
        dist.all_gather_object = original


def build_ddp_config(role):
    """megatron-core's `DistributedDataParallelConfig` of a trained role, from its flags
    (--ddp-num-buckets: the role's parameters over N per bucket, as Megatron-LM)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp_kwargs = core_kwargs.ddp_config_kwargs(role.args)
    if role.args.get("ddp_num_buckets"):  # as Megatron-LM: the role's parameters / N
        if role.args.get("bucket_size") is not None:
            raise ValueError("--ddp-num-buckets cannot be combined with --ddp-bucket-size")
        numel = sum(p.numel() for chunk in role.chunks for p in chunk.parameters())
        ddp_kwargs["bucket_size"] = max(numel // role.args["ddp_num_buckets"], 1)
    return DistributedDataParallelConfig(**ddp_kwargs)


def wrap_for_training(role, total_optimizer_steps: int | None) -> None:
    """Wrap a trained role's chunks and build its optimizer: sets `role.models` (one DDP
    wrapper per chunk, or FSDP2's with --use-torch-fsdp2), `role.optimizer` (built with the
    role's own groups), `role.lr_scheduler`, `role.gather_after_step`, and on `role.config` the
    hooks megatron-core's schedule calls (`finalize_model_grads_func`, `grad_scale_func`, the
    DDP sync functions). `total_optimizer_steps` as `MegatronRole`'s."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if role.args.get("use_torch_fsdp2"):  # parameters become DTensors: `models.torch_fsdp2`
        role.models = torch_fsdp2.wrap_chunks(
            role.chunks, role.config, role.args, role.spec.use_te, role.pgc.dp_cp
        )
        ddp_config = role.models[0].ddp_config
    else:
        ddp_config = build_ddp_config(role)
        # One DDP wrapper per model chunk, buckets for the first only (Megatron-LM's
        # get_model).
        role.models = [
            DistributedDataParallel(
                role.config, ddp_config, chunk, disable_bucketing=v > 0,
                pg_collection=role.pgc,
            )  # fmt: skip
            for v, chunk in enumerate(role.chunks)
        ]
    # Reduces gradients over data-parallel ranks (and tied embeddings over stages) at the
    # end of each step's backward; the schedule passes our pg_collection to it.
    role.config.finalize_model_grads_func = megatron_fixes.finalize_model_grads_in_role
    opt_kwargs = core_kwargs.optimizer_config_kwargs(role.args)
    opt_kwargs.setdefault("bf16", bool(role.args.get("bf16")))
    opt_kwargs["use_distributed_optimizer"] = ddp_config.use_distributed_optimizer
    with role_scoped_object_gather(role.pgc.intra_dist_opt):
        role.optimizer = get_megatron_optimizer(
            OptimizerConfig(**opt_kwargs),
            role.models,
            use_gloo_process_groups=False,
            pg_collection=role.pgc,
        )
    dump_path = role.args.get("dump_param_to_param_group_map")
    if dump_path and role.role == "train":  # megatron-core's own writer cannot run here
        param_groups.dump_param_to_param_group_map(
            dump_path, role.optimizer, role.models, role.config.num_moe_experts, role.pgc
        )
    elif dump_path and dist.get_rank(role.pgc.intra_dist_opt) == 0:
        warn_once(
            f"--dump-param-to-param-group-map is written for the train role only; the "
            f"{role.role} role's optimizer groups are not written"
        )
    role.lr_scheduler = lr_schedule.build_lr_scheduler(
        role.optimizer, role.args, total_optimizer_steps
    )
    # As Megatron-LM's training loop wires them: the schedule multiplies each micro-batch
    # loss by the optimizer's loss scale (fp16; 1 otherwise), and with an overlapped grad
    # reduce / param gather it drives DDP's sync hooks across micro-batches.
    role.config.grad_scale_func = role.optimizer.scale_loss
    # (one function, or one per model chunk for the interleaved schedule)
    if ddp_config.overlap_grad_reduce:
        role.config.no_sync_func = _per_chunk([m.no_sync for m in role.models])
        if role.args.get("align_grad_reduce", True):
            role.config.grad_sync_func = _per_chunk([m.start_grad_sync for m in role.models])
    role.gather_after_step = bool(ddp_config.overlap_param_gather)
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        role.config.param_sync_func = _per_chunk([m.start_param_sync for m in role.models])


def _per_chunk(funcs: list):
    """A DDP hook for the schedule's config: the one chunk's, or the list of each chunk's."""
    return funcs[0] if len(funcs) == 1 else funcs
