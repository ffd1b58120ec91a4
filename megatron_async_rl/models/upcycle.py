"""MoE upcycling (Megatron-LM's `--moe-use-upcycling`, `--moe-upcycling-granularity`): a dense
HF checkpoint becomes the checkpoint of its family's MoE twin, whose MoE layers compute exactly
what the dense MLPs did, until training moves them apart.

Owned here: `UpcyclePlan` (checked from one role's Megatron args by `plan_upcycling`, which
`recipe/load.py` calls while a recipe resolves), the conversion itself (`upcycled_hf_config`,
`upcycle_state_dict`), and `use_upcycled`, which `train.py` calls once the world is up: rank 0
writes the MoE checkpoint to `<run_dir>/upcycled_hf` (shared by every node, as checkpoints are),
the others wait, and every rank then reads `model.hf_path` from there, so the Megatron roles, the
SGLang engines, weight sync (HF names) and the HF export all see one MoE model.

The layout is megatron-core's (`transformer/moe/upcycling_utils.py`): with granularity G each
dense FFN (hidden size F) is cut along F into G slices of F/G; expert e holds slice e % G, and
experts gG .. gG+G-1 (one whole copy of the dense FFN) share one router row, drawn N(0, std^2)
with the dense model's `initializer_range`, as megatron-core's router init. Top-k (a multiple of
G) then picks whole copies, and the renormalised top-k weights (Qwen3-MoE's `norm_topk_prob`,
megatron-core's default without `--moe-router-pre-softmax`) of the G experts of the picked
copies sum to 1/G; each expert's `down_proj` carries the factor G, so the layer equals the dense
MLP for every token. megatron-core spreads that factor as G^(1/3) over gate, up and down
projections, which is exact only at G = 1 (SiLU is not homogeneous); down_proj is linear, so the
whole factor goes there. With `--moe-router-pre-softmax` (top-k weights that do not sum to 1,
megatron-core's E*G/k factor matches only on average) or top-1 (megatron-core needs pre-softmax
there) no initialisation is exact: both are refused.

Why not megatron-core's `upcycle_state_dict`: it converts between two built Megatron models (a
dense and an MoE `GPTModel`, each with its process groups), while here the MoE checkpoint must
exist in HF form before any role builds a model or any engine starts, and its G > 1 scaling is
not exact (above). The plan is checked while a recipe resolves, which imports no torch
(`tests/unit/test_layering.py`): torch and safetensors are imported where tensors are made.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_async_rl.config.errors import ConfigError, warn_once
from megatron_async_rl.models import hf_config as hf

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)

UPCYCLED_DIR = "upcycled_hf"
"""Where `use_upcycled` writes the MoE checkpoint, under the run directory."""
PLAN_FILE = "upcycling.json"
"""The plan, source and seed a written checkpoint was made from (a rerun reuses a match)."""
MOE_TWIN = {"qwen3": "qwen3_moe"}
"""Dense model_type -> the MoE model_type its upcycled checkpoint becomes."""
_DENSE_MLP = re.compile(r"^(.*\.layers\.(\d+)\.mlp)\.(gate|up|down)_proj\.weight$")
_FLAG = "--moe-use-upcycling"
# What the upcycled qwen3_moe routes with, the flag that would change it, and why it may not.
_ROUTING = (
    ("moe_router_pre_softmax", False, "--moe-router-pre-softmax",
     "the top-k weights would not sum to 1 (they vary per token), so no upcycled layer equals "
     "the dense MLP; the upcycled model renormalises them (qwen3_moe norm_topk_prob)"),
    ("moe_router_score_function", "softmax", "--moe-router-score-function",
     "the upcycled qwen3_moe routes by softmax"),
    ("moe_router_topk_scaling_factor", None, "--moe-router-topk-scaling-factor",
     "qwen3_moe has no routing scaling factor; the renormalised weights keep the dense output"),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class UpcyclePlan:
    """The MoE shape a dense checkpoint is upcycled into."""

    num_experts: int
    topk: int
    granularity: int
    """G: slices of each dense FFN (its hidden size / the experts')."""
    moe_ffn_hidden_size: int | None
    """F / G; None only in a dry run that could not read the dense checkpoint."""

    def moe_args(self) -> dict[str, Any]:
        """The Megatron args the upcycled model adds to the dense architecture."""
        args = {
            "num_experts": self.num_experts, "moe_router_topk": self.topk, "moe_layer_freq": 1,
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
            "moe_router_topk_scaling_factor": None,
        }  # fmt: skip
        if self.moe_ffn_hidden_size is not None:
            args["moe_ffn_hidden_size"] = self.moe_ffn_hidden_size
        return args


def plan_upcycling(args: Mapping[str, Any], dense: dict | None, role: str) -> UpcyclePlan | None:
    """The plan of one role's Megatron args (defaults < the dense architecture < recipe and
    flags), or None without `--moe-use-upcycling`. `dense`: model.hf_path's config.json (None in
    a dry run that cannot read it: its model and FFN size go unchecked). ConfigError names the
    flag, the value and the rule each bad combination breaks."""
    granularity = args.get("moe_upcycling_granularity")
    granularity = 1 if granularity is None else granularity
    where = f" (role {role})"
    if not args.get("moe_use_upcycling"):
        if granularity != 1:
            warn_once(f"--moe-upcycling-granularity {granularity} is ignored without "
                      f"{_FLAG}{where}")  # fmt: skip
        return None
    model_type = dense.get("model_type") if dense is not None else None
    if model_type is not None and model_type not in MOE_TWIN:
        already = any(k in dense for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        rule = (
            f"model.hf_path is already an MoE model (model_type {model_type!r})"
            if already
            else f"model.hf_path's model_type {model_type!r} has no supported MoE twin"
        )
        raise ConfigError(_FLAG, True, f"{rule}: upcycling turns a dense checkpoint into its "
                          f"family's MoE ({', '.join(f'{d} -> {m}' for d, m in MOE_TWIN.items())})",
                          "start from a dense qwen3 checkpoint, or drop the flag")  # fmt: skip
    experts, topk = args.get("num_experts"), args.get("moe_router_topk")
    if experts is None:
        raise ConfigError(
            "--num-experts",
            None,
            f"{_FLAG} needs the number of experts{where}",
            "add --num-experts N (a multiple of --moe-upcycling-granularity)",
        )
    if granularity < 1:
        raise ConfigError("--moe-upcycling-granularity", granularity, "must be >= 1")
    by_g = f"must be a multiple of --moe-upcycling-granularity = {granularity}"
    if experts % granularity:
        raise ConfigError(
            "--num-experts", experts, f"{by_g}: each dense FFN becomes {granularity} experts{where}"
        )
    if topk % granularity:
        raise ConfigError("--moe-router-topk", topk, f"{by_g}: a token must reach every slice "
                          f"of each copy of the dense FFN it is routed to{where}")  # fmt: skip
    if topk < 2:
        raise ConfigError("--moe-router-topk", topk, "must be >= 2 for upcycling: megatron-core "
                          "routes top-1 only with --moe-router-pre-softmax, whose weight (< 1, "
                          "varying per token) keeps no layer equal to the dense MLP",
                          "use --moe-router-topk 2 or more")  # fmt: skip
    for dest, wanted, flag, rule in _ROUTING:
        if args.get(dest, wanted) != wanted:
            raise ConfigError(flag, args[dest], f"cannot be combined with {_FLAG}: {rule}{where}",
                              "drop the flag")  # fmt: skip
    freq = args.get("moe_layer_freq", 1)
    if freq != 1 and not (isinstance(freq, list) and set(freq) == {1}):
        raise ConfigError("--moe-layer-freq", freq, f"{_FLAG} makes every layer MoE (qwen3_moe)"
                          f"{where}", "drop the flag")  # fmt: skip
    if args.get("load"):
        raise ConfigError("--load", args["load"], f"{_FLAG} upcycles model.hf_path before any "
                          f"role loads; a role loading --load would skip it{where}",
                          "set model.hf_path to the dense checkpoint and drop --load")  # fmt: skip
    ffn = int(dense["intermediate_size"]) if dense is not None else args.get("ffn_hidden_size")
    given_ffn = args.get("ffn_hidden_size")
    if ffn is not None and given_ffn is not None and given_ffn != ffn:
        raise ConfigError("--ffn-hidden-size", given_ffn, f"with {_FLAG} the dense FFN size is "
                          f"model.hf_path's ({ffn}); Megatron-LM's --ffn-hidden-size means the "
                          f"experts' size, which is --moe-ffn-hidden-size here{where}",
                          f"drop it (the experts get {ffn} / {granularity})")  # fmt: skip
    if ffn is None:
        return UpcyclePlan(experts, topk, granularity, args.get("moe_ffn_hidden_size"))
    if ffn % granularity:
        raise ConfigError("--moe-upcycling-granularity", granularity, f"must divide the dense "
                          f"FFN size {ffn} (model.hf_path's intermediate_size){where}")  # fmt: skip
    moe_ffn = args.get("moe_ffn_hidden_size")
    if moe_ffn is not None and moe_ffn != ffn // granularity:
        raise ConfigError("--moe-ffn-hidden-size", moe_ffn, f"must be the dense FFN size / "
                          f"--moe-upcycling-granularity = {ffn} / {granularity} = "
                          f"{ffn // granularity} for upcycling{where}",
                          "drop it (it is derived)")  # fmt: skip
    return UpcyclePlan(experts, topk, granularity, ffn // granularity)


def plan_of(role_args: Mapping[str, Mapping[str, Any]]) -> UpcyclePlan | None:
    """The plan of a resolved config (`ResolvedConfig.role_megatron_args`; the recipe checked
    that every role loading model.hf_path has the same one), or None."""
    for args in role_args.values():
        if args.get("moe_use_upcycling"):
            return UpcyclePlan(args["num_experts"], args["moe_router_topk"],
                               args.get("moe_upcycling_granularity") or 1,
                               args["moe_ffn_hidden_size"])  # fmt: skip
    return None


def upcycled_hf_config(dense: dict, plan: UpcyclePlan) -> dict[str, Any]:
    """The config.json of the upcycled model: the dense model's architecture as its MoE twin,
    written by the exporter's own `hf_config_from_megatron_args` (token ids and dtype kept)."""
    args = {**hf.megatron_args_from_hf(dense), **plan.moe_args()}
    return hf.hf_config_from_megatron_args(args, MOE_TWIN[dense["model_type"]], base=dense)


def upcycle_state_dict(
    dense_sd: Mapping[str, Tensor], plan: UpcyclePlan, init_std: float, seed: int
) -> dict[str, Tensor]:
    """The MoE tensors (HF hub names) of dense tensors `dense_sd`, all of a model or any set of
    whole layers of it: each `<layer>.mlp.{gate,up,down}_proj.weight` triple becomes
    `<layer>.mlp.gate.weight` (the router, rows tied in copies of G) and
    `<layer>.mlp.experts.{e}.{gate,up,down}_proj.weight`; other tensors pass through. The router
    rows of layer i come from a generator seeded by (`seed`, i), so the result does not depend
    on how the layers are batched."""
    import torch

    out: dict[str, Tensor] = {}
    mlps: dict[str, dict[str, Tensor]] = {}
    for name, tensor in dense_sd.items():
        match = _DENSE_MLP.match(name)
        if match is None:
            out[name] = tensor
        else:
            mlps.setdefault(match[1], {"layer": int(match[2])})[match[3]] = tensor
    g, experts = plan.granularity, plan.num_experts
    for prefix, mlp in mlps.items():
        gate, up, down = mlp["gate"], mlp["up"], mlp["down"]
        width = gate.shape[0] // g
        generator = torch.Generator().manual_seed(seed * 1_000_003 + mlp["layer"])
        rows = torch.randn(experts // g, gate.shape[1], generator=generator) * init_std
        out[f"{prefix}.gate.weight"] = rows.repeat_interleave(g, dim=0).to(gate.dtype)
        for e in range(experts):
            part = slice((e % g) * width, (e % g + 1) * width)
            expert = f"{prefix}.experts.{e}."
            out[expert + "gate_proj.weight"] = gate[part].clone()
            out[expert + "up_proj.weight"] = up[part].clone()
            # the factor G on the linear projection alone: see the module docstring
            out[expert + "down_proj.weight"] = (down[:, part].float() * g).to(down.dtype)
    return out


def write_upcycled(src: str | Path, out: str | Path, plan: UpcyclePlan, seed: int) -> Path:
    """Write the MoE checkpoint upcycled from the dense one at `src` to `out`: one safetensors
    file per decoder layer (one layer's experts in memory at a time) plus an index, config.json
    and the tokenizer files. A checkpoint already at `out` made from the same source, plan and
    seed (`PLAN_FILE`) is kept (a resumed run); any other is replaced."""
    from safetensors.torch import save_file

    from megatron_async_rl.models import hf_checkpoint

    out = Path(out)
    made_from = {"source": str(Path(src).resolve()), "seed": seed, **dataclasses.asdict(plan)}
    if (out / PLAN_FILE).is_file() and json.loads((out / PLAN_FILE).read_text()) == made_from:
        logger.info("reusing the upcycled checkpoint %s", out)
        return out
    dense = hf_checkpoint.read_hf_config(src)
    config = upcycled_hf_config(dense, plan)
    reader = hf_checkpoint.HFTensorReader(src)
    by_layer: dict[int, list[str]] = {}
    for name in reader.keys():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        by_layer.setdefault(int(layer[1]) if layer else -1, []).append(name)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map, total = {}, 0
    init_std = float(dense.get("initializer_range", 0.02))
    for i, layer in enumerate(sorted(by_layer)):
        tensors = upcycle_state_dict({n: reader.read(n) for n in by_layer[layer]}, plan,
                                     init_std, seed)  # fmt: skip
        file = f"model-{i + 1:05d}-of-{len(by_layer):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial / file),
                  metadata={"format": "pt"})  # fmt: skip
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (partial / hf_checkpoint.INDEX_FILE).write_text(json.dumps(index, indent=2))
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for name in hf_checkpoint.TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, partial / name)
    (partial / PLAN_FILE).write_text(json.dumps(made_from, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    logger.info("upcycled %s into %s: %d experts (top-%d, granularity %d) per layer", src, out,
                plan.num_experts, plan.topk, plan.granularity)  # fmt: skip
    return out


def use_upcycled(cfg: Any, is_writer: bool, wait: Callable[[], None]) -> Any:
    """`cfg` (a ResolvedConfig) with `model.hf_path` at the upcycled checkpoint, which the
    writer (rank 0) makes under the run directory while the others `wait` (a barrier); `cfg`
    itself without `--moe-use-upcycling`. Called by train.py before any role or engine loads."""
    plan = plan_of(cfg.role_megatron_args)
    if plan is None:
        return cfg
    out = Path(cfg.run_dir) / UPCYCLED_DIR
    if is_writer:
        write_upcycled(cfg.model.hf_path, out, plan, cfg.seed)
    wait()
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path=str(out)))
