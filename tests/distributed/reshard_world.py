"""One spawned world per (model, engine TP): one SGLang engine start, many train layouts.

Used by `test_reshard_sglang.py` (engine TP=1) and `test_reshard_engine_tp2.py` (engine TP=2),
which assert on what `run_world` returns. The world has `WORLD_SIZE` gloo ranks: ranks 0-3 may
hold the train role (and logp), rank `ENGINE_RANK` hosts the real SGLang engine, started once for
the whole world. For each `Layout` in turn every rank builds that layout's `WorldGroups`
(collective: the same layouts in the same order on every rank) over the windows

    [train(+logp) x num_train] [ref x (4 - num_train), when > 0] [generate x 1]

the train ranks build fresh `MegatronRole`s from the checkpoint and change the weights (one real
optimizer step, or `_perturb`), and every participant syncs into the engine, which then reads the
weights back and generates. Ranks a layout leaves idle hold the `ref` window: they build its
groups but take no part in the sync (`weight_sync` spans train, logp and generate only).

Layout `i` syncs versions `10 * i + 1`, `10 * i + 2`, ... and trains on batches seeded from
`10 * i`, so what the engine serves before a layout's sync (the previous layout's weights)
differs from what it must serve after it: a sync that changed nothing fails the checks.

A failure in a layout is recorded under its name with the traceback; the ranks still in its
collectives see gloo's timeout (120 s) and record theirs. The world stops there: the tests of
that layout fail naming it, and later layouts report that they did not run.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback

import pytest
import torch

from tests.harness.ranks import spawn

WORLD_SIZE, ENGINE_RANK, NUM_TRAIN_SLOTS = 5, 4, 4
PRODUCE_MB, CONSUME_MB = 0.03, 0.01
CHANGED = "model.layers.0.mlp.up_proj.weight"  # a tensor the engine reads back unpadded


@dataclasses.dataclass(frozen=True)
class Layout:
    """One train layout of a world, and what its ranks do with it."""

    name: str
    """The test ID of the layout."""
    parallel: dict
    """Megatron parallel sizes of the train role (and logp, which shares its window)."""
    num_train: int
    kind: str
    """"dense": read the weights back through the engine; "moe": compare greedy generations
    (SGLang 0.5.21 reads back Llama-family weights only)."""
    roles: tuple[str, ...] = ("train", "logp")
    transport: str = "auto"
    small_buckets: bool = True
    """`PRODUCE_MB` / `CONSUME_MB`, so that tensors are cut into pieces; else the defaults."""
    faults: bool = False
    """After v1: a corrupted message (persistent, then healed on retry), then a rejected load."""
    perturb: bool = False
    """Change the weights with `_perturb` instead of an optimizer step (MoE with TP > 1 cannot
    train on CPU: Megatron needs sequence parallel, which the local spec's RMSNorm refuses)."""


TP2, PP2, EP2 = (
    {"tensor_model_parallel_size": 2},
    {"pipeline_model_parallel_size": 2},
    {"expert_model_parallel_size": 2},
)
# (train layout, number of train ranks) of the MoE tests, here and with engine TP=2.
MOE = [
    Layout("train_ep2", EP2, 2, "moe"),
    Layout("train_tp2_ep2", TP2 | EP2, 4, "moe", perturb=True),
]


def run_world(path, engine_tp_size: int, layouts: list[Layout], tmp_path) -> dict:
    """Spawn the world; returns {layout name: results of its participating ranks (rank order)
    or the error text}."""
    per_rank = spawn(_worker, WORLD_SIZE, tmp_path, str(path), engine_tp_size, layouts)
    world = {}
    for layout in layouts:
        outs = [out.get(layout.name) for out in per_rank]
        errors = [o["error"] for o in outs if o is not None and "error" in o]
        if errors:
            world[layout.name] = "\n".join(errors)
        elif any(o is None for o in outs):
            world[layout.name] = f"layout {layout.name} did not run: an earlier one failed"
        else:
            world[layout.name] = [o for o in outs if not o["idle"]]
    return world


def layout_results(world: dict, name: str) -> list[dict]:
    """The results of layout `name`, or the test fails with the worker's error."""
    results = world[name]
    if isinstance(results, str):
        pytest.fail(f"layout {name} failed in the world:\n{results}", pytrace=False)
    return results


def label(results: list[dict], k: int) -> str:
    """The engine's version label of the layout's k-th sync (1-based)."""
    return f"v{results[0]['base'] + k}"


def _worker(rank, world_size, tmp_dir, path, engine_tp_size, layouts):
    from megatron_async_rl.distributed.platform import detect_platform
    from megatron_async_rl.engines.sglang.engine import SGLangEngine, SGLangEngineConfig

    platform = detect_platform("cpu", "gloo")
    engine, out = None, {}
    try:
        if rank == ENGINE_RANK:
            config = SGLangEngineConfig(
                model_path=path, dtype="float32", max_total_tokens=4096, tp_size=engine_tp_size
            )
            engine = SGLangEngine(config, rank_in_role=0, global_rank=rank)
        for index, layout in enumerate(layouts):
            try:
                out[layout.name] = _run_layout(rank, path, layout, 10 * index, platform, engine)
            except Exception:  # noqa: BLE001 - reported by the layout's tests
                error = f"global rank {rank}, layout {layout.name}:\n{traceback.format_exc()}"
                out[layout.name] = {"error": error}
                break
            gc.collect()  # the layout's models, optimizers and DDP buffers
    finally:
        if engine is not None:
            engine.shutdown()
    return out


def _build(rank, path, layout: Layout, platform):
    """This layout's groups (collective) and, on its train ranks, its freshly loaded roles."""
    import torch.distributed as dist

    from megatron_async_rl.distributed.groups import build_world_groups
    from megatron_async_rl.distributed.layout import Parallelism, plan_layout
    from megatron_async_rl.recipe.schema import RoleGroupSpec
    from megatron_async_rl.roles.megatron_role import MegatronRole
    from tests.harness.roles import role_args

    args = role_args(path, **layout.parallel)
    args.update(lr=1e-2, clip_grad=0.0)
    par = Parallelism.from_megatron_args(args)
    specs = [RoleGroupSpec(list(layout.roles), num_ranks=layout.num_train)]
    if layout.num_train < NUM_TRAIN_SLOTS:
        specs.append(RoleGroupSpec(["ref"], num_ranks=NUM_TRAIN_SLOTS - layout.num_train))
    specs.append(RoleGroupSpec(["generate"], 1))
    world_layout = plan_layout(WORLD_SIZE, specs, dict.fromkeys(layout.roles, par))
    groups = build_world_groups(world_layout, platform.backend)
    roles = {}
    if rank < layout.num_train:
        for name in layout.roles:
            roles[name] = MegatronRole(name, args, par, groups.roles[name], platform, seed=5)
            roles[name].load_hf_checkpoint(path)
    dist.barrier(group=groups.control)
    return groups, roles


def _run_layout(rank, path, layout: Layout, base: int, platform, engine) -> dict:
    import torch.distributed as dist

    groups, roles = _build(rank, path, layout, platform)
    out = {"rank": rank, "base": base, "idle": rank not in groups.weight_sync_ranks}
    if layout.kind == "dense":
        _dense(out, path, layout, base, groups, roles, engine)
    else:
        _moe(out, layout, base, groups, roles, engine)
    dist.barrier(group=groups.control)
    return out


def _sync_config(layout: Layout):
    from megatron_async_rl.weight_sync.config import WeightSyncConfig

    if not layout.small_buckets:
        return WeightSyncConfig(transport=layout.transport)
    return WeightSyncConfig(
        produce_bucket_mb=PRODUCE_MB, consume_bucket_mb=CONSUME_MB, transport=layout.transport
    )


def _train_step(roles, seed):
    if "train" in roles:
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 96, (2, 10), generator=generator)
        roles["train"].train_step([{"tokens": tokens}], lambda logp, ent, mb: (-logp.mean(), {}))


def _perturb(roles):
    """An element-wise update, the same on every shard and replica (a stand-in for a step)."""
    if "train" in roles:
        with torch.no_grad():
            for param in roles["train"].module.parameters():
                param.mul_(1.01).add_(1e-3)


def _greedy(engine):
    from megatron_async_rl.engines.protocol import GenerateRequest, SamplingParams

    sampling = SamplingParams(max_new_tokens=6, temperature=0.0)
    result = engine.generate([GenerateRequest([7, 12, 30, 4], sampling, "greedy")])[0]
    return result.output_ids, result.output_logprobs, result.token_versions


def _error_of(fn):
    try:
        fn()
    except RuntimeError as err:
        return str(err)
    return None


def dense_names(path):
    from megatron_async_rl.models.hf_checkpoint import load_hf_state_dict

    return sorted(load_hf_state_dict(path))


def _collect(out, roles, engine, path, key):
    """The trainer's (and logp's) gathered weights, the engine's read-back and versions."""
    if "train" in roles:
        trainer = roles["train"].gather_hf_state_dict()
        logp = roles["logp"].gather_hf_state_dict() if "logp" in roles else None
        if trainer is not None:
            out[f"trainer_{key}"] = trainer
            if logp is not None:
                out[f"logp_{key}"] = logp
    if engine is not None:
        engine_weights = {n: engine.get_weights_by_name(n) for n in dense_names(path)}
        out[f"engine_{key}"] = (engine_weights, _greedy(engine)[2])


def _dense(out, path, layout: Layout, base, groups, roles, engine):
    from megatron_async_rl.weight_sync import buffers
    from megatron_async_rl.weight_sync.broadcast import sync_weights, warm_up

    config = _sync_config(layout)
    if engine is not None:
        out["before"] = engine.get_weights_by_name(CHANGED)
    # The start-up warm-up allocates every buffer the first sync then reuses (finding 8).
    pool = buffers.BufferPool()
    streaming = engine is not None and "logp" not in roles
    warm_up(groups, roles, config, pool, streaming=streaming)
    warmed = pool.allocations
    _train_step(roles, seed=base)
    out["metrics"] = sync_weights(groups, roles, engine, base + 1, config, pool)
    out["allocated_after_warm_up"] = (warmed, pool.allocations - warmed)
    _collect(out, roles, engine, path, "v1")
    if not layout.faults:
        return
    # v2 with one payload byte flipped on the wire by the first sender, after its checksum:
    # on every attempt (the sync fails), then on the first attempt only (the second heals).
    v2, v3 = base + 2, base + 3
    _train_step(roles, seed=base + 1)
    original, flips = buffers.pack, []
    persistent = True

    def corrupt(buf, message, *args, seq, **kwargs):
        original(buf, message, *args, seq=seq, **kwargs)
        if seq == 0 and (persistent or not flips):
            buf[buffers.HEADER_BYTES] ^= 0x10
            flips.append(seq)

    if groups.rank == min(groups.weight_senders):
        buffers.pack = corrupt
    try:
        out["corrupt"] = _error_of(lambda: sync_weights(groups, roles, engine, v2, config))
        if engine is not None:
            served = {n: engine.get_weights_by_name(n) for n in dense_names(path)}
            out["after_corrupt"] = (engine.weight_version(), served, _greedy(engine)[2])
        persistent, flips = False, []
        out["healed"] = sync_weights(groups, roles, engine, v2, config)
    finally:
        buffers.pack = original
    _collect(out, roles, engine, path, "v2")
    # v3: the engine rejects its third load call of every attempt (two loads went in).
    if engine is not None:
        load, begin, calls = engine.update_weights, engine.begin_weight_update, [0]

        def reject(named_tensors, version, flush_cache=True):
            calls[0] += 1
            if calls[0] == 3:
                raise ValueError("shape mismatch, say")
            load(named_tensors, version, flush_cache)

        def begin_counting():
            calls[0] = 0
            begin()

        engine.update_weights, engine.begin_weight_update = reject, begin_counting
    _train_step(roles, seed=base + 2)
    try:
        out["rejected"] = _error_of(lambda: sync_weights(groups, roles, engine, v3, config))
        if engine is not None:
            out["after_reject"] = (engine.weight_version(), _error_of(lambda: _greedy(engine)))
    finally:
        if engine is not None:
            del engine.update_weights, engine.begin_weight_update  # the class's methods again
    sync_weights(groups, roles, engine, v3, config)  # a complete update: serving again
    _collect(out, roles, engine, path, "v3")


def _moe(out, layout: Layout, base, groups, roles, engine):
    import torch.distributed as dist

    from megatron_async_rl.weight_sync.broadcast import load_into_engine, sync_weights

    before = _greedy(engine) if engine is not None else None
    if layout.perturb:
        _perturb(roles)
    else:
        _train_step(roles, seed=base)
    sync_weights(groups, roles, engine, version=base + 1, config=_sync_config(layout))
    trainer = logp = None
    if "train" in roles:
        trainer = roles["train"].gather_hf_state_dict()
        logp = roles["logp"].gather_hf_state_dict()
    if trainer is not None:
        out.update(trainer=trainer, logp=logp)
    # The trainer's gathered HF state dict goes to the generate rank as whole tensors.
    box = [trainer]
    dist.broadcast_object_list(box, src=0, group=groups.control)
    if engine is not None:
        resharded = _greedy(engine)
        load_into_engine(engine, box[0], version=base + 2)
        reference = _greedy(engine)
        out.update(before=before, resharded=resharded, reference=reference)


def check_served(engine_weights, trainer):
    """Every HF tensor read back from the engine is bit-identical to the trainer's."""
    assert engine_weights.keys() == trainer.keys()
    for name, ours in trainer.items():
        got = engine_weights[name]
        # SGLang pads the vocab rows of embed/lm_head with zeros (to a multiple of 64 x TP).
        assert torch.equal(got[: ours.shape[0]].to(ours.dtype), ours), name
        assert not got[ours.shape[0] :].any(), name


def check_changed(results, start):
    """The layout's step changed the weights, and the engine served other weights before the
    sync (the start or the previous layout's): otherwise the read-back checks prove nothing."""
    trainer = next(r["trainer_v1"] for r in results if "trainer_v1" in r)
    before = next(r["before"] for r in results if "before" in r)
    assert not trainer[CHANGED].equal(start[CHANGED]), "the step changed nothing: vacuous check"
    assert not before.equal(trainer[CHANGED]), "the engine served these weights already"


def check_moe(results):
    """The `_moe` contract: logp holds the trainer's weights; the engine, after the sync,
    computes exactly what it computes from the trainer's gathered HF state dict, not the old."""
    trainer = next(r["trainer"] for r in results if "trainer" in r)
    logp = next(r["logp"] for r in results if "logp" in r)
    for name, tensor in trainer.items():
        assert torch.equal(logp[name], tensor), name
    served = next(r for r in results if "resharded" in r)
    ids, logprobs, versions = served["resharded"]
    assert set(versions) == {label(results, 1)}
    assert (ids, logprobs) == served["reference"][:2]
    assert logprobs != served["before"][1], "the sync did not change what the engine computes"
