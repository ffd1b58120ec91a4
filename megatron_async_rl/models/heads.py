"""Scalar heads on Megatron GPT models: the critic's value per token, the reward model's score.

Owned here: `ScalarHead`, which takes the place of a GPTModel's LM output layer (hidden -> padded
vocabulary, split over TP) with hidden -> 1 (HF `num_labels=1`); `attach_scalar_head`, which
swaps it in (`models.builder.build_gpt_chunks`, for a `ModelSpec` with a head); `head_reader`, the
HF side of loading it (shape checks, and the initial head of a checkpoint without one: a critic
starting from the policy's checkpoint); and the reward model's pooling at each row's last non-pad
token (`last_non_pad_index`). Called by `models.builder`, `models.weights` and
`roles.megatron_role` (`values`, `scores`, `train_step(outputs="values")`); the HF names are
`models.dims`' (`HEAD_HF_NAMES`).

Kinds:
- "value": a value per token, HF `*ForTokenClassification` (`score` = Linear(hidden, 1), with a
  bias);
- "score": one score per sequence, at its last token that is not the pad token, HF
  `*ForSequenceClassification` (`score` = Linear(hidden, 1, bias=False)).

Tensor parallelism. The head is replicated on every TP rank of the last stage (a 1 x hidden
weight is not worth splitting). megatron-core 0.16.1 `GPTModel._postprocess` calls
`output_layer(hidden_sbh, weight=None, runtime_gather_output=...)` and transposes the result to
[b, s, 1]; the hidden state there is the final norm's output:
- without sequence parallelism it is whole and identical on every TP rank (the last layer's
  row-parallel projections all-reduce their outputs; the final norm is replicated). Every rank
  computes the same output, loss and gradients, so the gradient into the decoder is already the
  whole one: no all-reduce in the backward (`ColumnParallelLinear` needs one because each vocab
  slice gives only part of it, and the head must not add one: that would multiply the decoder's
  gradients by TP), and the head's own gradient is identical on every rank (no reduction);
- with sequence parallelism it is this rank's sequence chunk [s/tp, b, h] (`ColumnParallelLinear`
  all-gathers it in its forward). The head maps the chunk to [s/tp, b, 1] and all-gathers that
  (`gather_from_sequence_parallel_region(tensor_parallel_output_grad=False)`: its backward keeps
  this rank's chunk of the replicated gradient). The head's gradient is then a sum over this
  rank's tokens only: its parameters carry `sequence_parallel = True`, so megatron-core's
  `finalize_model_grads` sums it over TP, as it does the norms' under sequence parallelism.
Either way grad-norm clipping counts the head once (no `tensor_model_parallel` attribute: only TP
rank 0's copy counts, as for the norms), and DDP averages it over data-parallel ranks.

Shapes: B batch, T sequence (batch-first, the role's tensors); s, b, h megatron-core's
[sequence, batch, hidden] inside the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_async_rl.models.dims import HEAD_HF_NAMES, ModelDims, hf_shape

HEAD_KINDS = tuple(HEAD_HF_NAMES)
"""("value", "score")."""


def check_kind(head: str | None) -> None:
    """A head kind is one of `HEAD_KINDS` (None: the LM head)."""
    if head is not None and head not in HEAD_KINDS:
        raise ValueError(f"head={head!r} is not one of {HEAD_KINDS} (or None for the LM head)")


class ScalarHead(torch.nn.Module):
    """hidden [s, b, h] -> ([s, b, 1], None), replicated over TP: GPTModel's `output_layer`
    call contract. `weight` [1, h] (HF `score.weight`), `bias` [1] or None (`score.bias`)."""

    def __init__(
        self, hidden_size: int, *, bias: bool, dtype: torch.dtype, sequence_parallel: bool,
        tp_group, init_std: float, seed: int,
    ):  # fmt: skip
        super().__init__()
        # Its own generator: every TP rank (and every device) draws the same head.
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=generator) * init_std
        self.weight = torch.nn.Parameter(weight.to(dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel  # finalize_model_grads sums it over TP
        self.tp_group = tp_group
        self.gather_sequence = sequence_parallel and dist.get_world_size(tp_group) > 1

    def forward(self, hidden_sbh: Tensor, weight: Tensor | None = None,
                runtime_gather_output: bool | None = None):  # fmt: skip
        # A tied output weight would be the embedding's: `attach_scalar_head` refuses ties.
        assert weight is None, "a scalar head has its own weight"
        out_sb1 = torch.nn.functional.linear(hidden_sbh, self.weight, self.bias)
        if self.gather_sequence:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            out_sb1 = gather_from_sequence_parallel_region(
                out_sb1, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return out_sb1, None


HF_TASK_SUFFIXES = {"value": "ForTokenClassification", "score": "ForSequenceClassification"}
"""The HF class a head's checkpoint loads as: `<Family>` + suffix (LlamaForTokenClassification)."""


def hf_head_config(base: dict, head: str) -> dict:
    """The HF `config.json` of a `head` model exported from `base` (a causal LM's or another
    head model's config): its architecture renamed to the head's class, one label."""
    check_kind(head)
    config = dict(base)
    names = []
    for arch in base.get("architectures") or []:
        family = arch
        for suffix in ("ForCausalLM", *HF_TASK_SUFFIXES.values()):
            family = family.removesuffix(suffix)
        names.append(family + HF_TASK_SUFFIXES[head])
    if not names:
        raise ValueError("the base config names no architectures: cannot name the head's class")
    config.update(architectures=names, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    config.pop("num_labels", None)
    return config


def attach_scalar_head(model, config, head: str, tp_group, seed: int) -> None:
    """Replace the LM output layer of `model` (a GPTModel stage built with untied embeddings)
    by a `head` ScalarHead, initialised N(0, init_method_std^2) from `seed`, bias zeros. Stages
    without the output layer are left as they are."""
    check_kind(head)
    if getattr(config, "mtp_num_layers", None):
        raise ValueError(
            f"--mtp-num-layers={config.mtp_num_layers}: multi-token prediction needs the LM "
            f"output layer; a {head} head replaces it (unset the flag)"
        )
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError(
            "--defer-embedding-wgrad-compute defers the LM output layer's weight gradient; a "
            f"{head} head replaces that layer (unset the flag)"
        )
    assert not model.share_embeddings_and_output_weights, "a head model has untied embeddings"
    if not model.post_process:
        return
    model.output_layer = ScalarHead(
        config.hidden_size,
        bias=len(HEAD_HF_NAMES[head]) > 1,
        dtype=config.params_dtype,
        sequence_parallel=bool(config.sequence_parallel),
        tp_group=tp_group,
        init_std=config.init_method_std,
        seed=seed,
    )


def head_reader(
    read: Callable[[str], Tensor], names: Iterable[str], dims: ModelDims,
    init_std: float | None, seed: int = 0, path: str = "<checkpoint>",
) -> tuple[Callable[[str], Tensor], list[str]]:  # fmt: skip
    """`read` and `names` of a HF checkpoint, completed with the head tensors `dims.head` needs.

    A head tensor the checkpoint lacks (a policy's causal-LM checkpoint has no `score`, a
    reward model's no `score.bias`) is made here when `init_std` is given: the weight
    N(0, init_std^2) drawn from `seed` (0: zeros), the bias zeros, the same on every rank.
    Head tensors present must have HF's num_labels=1 shape.
    """
    names = list(names)
    wanted = HEAD_HF_NAMES[dims.head]
    for name in wanted:
        if name in names:
            shape = tuple(read(name).shape)
            if shape != hf_shape(name, dims):
                raise ValueError(
                    f"HF checkpoint {path}: {name} has shape {shape}, not "
                    f"{hf_shape(name, dims)}: a {dims.head} head has num_labels=1"
                )
    missing = [name for name in wanted if name not in names]
    if not missing:
        return read, names
    if init_std is None:
        raise ValueError(
            f"HF checkpoint {path} has no {missing} for the {dims.head} head; to start the head "
            f"from a checkpoint without it (a policy's), give its init std (head_init_std; 0 for "
            f"zeros)"
        )
    if not init_std >= 0:
        raise ValueError(f"head_init_std={init_std}: must be >= 0 (0: a zero head)")
    generator = torch.Generator().manual_seed(seed)
    made = {
        name: torch.randn(hf_shape(name, dims), generator=generator) * init_std
        if name.endswith(".weight") else torch.zeros(hf_shape(name, dims))
        for name in missing
    }  # fmt: skip

    def read_with_head(name: str) -> Tensor:
        return made[name] if name in made else read(name)

    return read_with_head, names + missing


def last_non_pad_index(tokens_BT: Tensor, pad_id: int) -> Tensor:
    """[B] index of each row's last token that is not `pad_id`: the pooling of HF
    `*ForSequenceClassification` (right or left padding). A row of pads only is refused."""
    if not isinstance(pad_id, int) or isinstance(pad_id, bool):
        raise ValueError(f"pad_id={pad_id!r}: the pad token id (an int) is needed to pool scores")
    non_pad_BT = tokens_BT != pad_id
    empty = (~non_pad_BT.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty[:8]} hold only pad_id={pad_id}: no token to score")
    positions_T = torch.arange(tokens_BT.shape[1], device=tokens_BT.device)
    return (positions_T * non_pad_BT).argmax(dim=1)


def pool_last_non_pad(out_BT: Tensor, tokens_BT: Tensor, pad_id: int) -> Tensor:
    """[B] each row of `out_BT` at its last non-pad token (`last_non_pad_index`)."""
    index_B = last_non_pad_index(tokens_BT, pad_id)
    return out_BT.gather(1, index_B.unsqueeze(1)).squeeze(1)
