"""Reading and writing HuggingFace model directories (safetensors + config.json + tokenizer).

Owns the on-disk side of HF checkpoints: reading the `*.safetensors` of a directory, all of it or
tensor by tensor (`HFTensorReader`, honouring `model.safetensors.index.json`), reading
`config.json`, writing an export directory that `transformers` and SGLang load, and turning a
transformers 5 module's state dict into the hub layout (`to_hub_layout`). Called by model
building (HF init), export and tests; tensor layouts between Megatron and HF live in `models.names`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
# Files copied from `tokenizer_src`; generation_config.json carries the eos ids SGLang stops on.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)
_FUSED_EXPERTS_RE = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _model_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"HF model directory {str(p)!r} does not exist or is not a directory")
    return p


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of a HF model directory, as a dict."""
    config_path = _model_dir(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"HF model directory {str(path)!r} has no config.json")
    with open(config_path) as f:
        return json.load(f)


class HFTensorReader:
    """The tensors of a HF directory's safetensors files, read one at a time on request.

    `read(name)` reads only that tensor's bytes (safetensors' memory map: a rank that needs a
    tenth of the model reads a tenth); `bytes_read` counts them. With an index file only the
    files it names are read, and every indexed tensor must be found in its file.
    """

    def __init__(self, path: str | os.PathLike):
        model_dir = _model_dir(path)
        index_path = model_dir / INDEX_FILE
        if index_path.is_file():
            with open(index_path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
            missing_files = [str(f) for f in files if not f.is_file()]
            if missing_files:
                raise ValueError(f"{index_path} names files that do not exist: {missing_files}")
        else:
            weight_map, files = None, sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"HF model directory {str(model_dir)!r} has no *.safetensors files")
        self._files: dict[str, Any] = {}
        self._where: dict[str, Path] = {}
        for file in files:
            handle = safe_open(str(file), framework="pt", device="cpu")
            self._files[str(file)] = handle
            for key in handle.keys():
                if key in self._where:
                    raise ValueError(f"tensor {key!r} appears in more than one file of {model_dir}")
                self._where[key] = file
        if weight_map is not None and set(weight_map) != self._where.keys():
            missing = sorted(set(weight_map) - self._where.keys())[:8]
            raise ValueError(f"{index_path} lists tensors not found in its files: {missing}")
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._where)

    def read(self, name: str) -> Tensor:
        tensor = self._file(name).get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read_range(self, name: str, dim: int, start: int, stop: int) -> Tensor:
        """Rows (dim 0) or columns (dim 1) `start:stop` of a tensor, reading only those."""
        view = self._file(name).get_slice(name)
        index = (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop))
        tensor = view[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _file(self, name: str):
        if name not in self._where:
            raise KeyError(f"the HF checkpoint has no tensor {name!r}")
        return self._files[str(self._where[name])]


def load_hf_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of the directory's safetensors files, on CPU, in hub layout (see
    `HFTensorReader` to read only some)."""
    reader = HFTensorReader(path)
    return {key: reader.read(key) for key in reader.keys()}


def to_hub_layout(hf_sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A transformers 5 module state dict -> the hub (on-disk) names `models.names` uses.

    transformers 5.12.1 keeps MoE experts fused in the module, `mlp.experts.gate_up_proj`
    (E, 2F, H) with `[gate; up]` along dim 1 and `mlp.experts.down_proj` (E, H, F); on disk (its
    `qwen2_moe` conversion mapping, which `qwen3_moe` uses) and in SGLang they are per expert,
    `mlp.experts.{j}.{gate,up,down}_proj.weight`. Other keys pass through unchanged.
    """
    out: dict[str, Tensor] = {}
    for key, tensor in hf_sd.items():
        m = _FUSED_EXPERTS_RE.match(key)
        if not m:
            out[key] = tensor
            continue
        for j in range(tensor.shape[0]):
            prefix = f"{m[1]}.{j}."
            if m[2] == "down_proj":
                out[prefix + "down_proj.weight"] = tensor[j].clone()
            else:
                gate, up = tensor[j].chunk(2, dim=0)
                out[prefix + "gate_proj.weight"] = gate.clone()
                out[prefix + "up_proj.weight"] = up.clone()
    return out


def _owned(tensor: Tensor) -> Tensor:
    """A CPU contiguous tensor that owns its whole storage (safetensors rejects shared memory)."""
    t = tensor.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def _write_atomic(target: Path, write: Any) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    write(tmp)
    os.replace(tmp, target)


def save_hf_checkpoint(
    path: str | os.PathLike,
    hf_sd: Mapping[str, Tensor],
    hf_config: dict[str, Any],
    tokenizer_src: str | os.PathLike | None,
) -> Path:
    """Writes `model.safetensors`, `config.json` and the tokenizer files of `tokenizer_src`.

    Each file is written under a temporary name and renamed, so a reader (e.g. SGLang's
    `update_weights_from_disk`) never sees half a file. A directory holding other safetensors
    files or an index is refused: `load_hf_state_dict` would mix them with the new weights.
    """
    copied: list[str] = []
    if tokenizer_src is not None:
        src = _model_dir(tokenizer_src)
        copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
        if not any(name.startswith("tokenizer") for name in copied):
            raise ValueError(f"tokenizer_src {str(src)!r} holds no tokenizer files")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    stale = [p.name for p in out.glob("*.safetensors") if p.name != WEIGHTS_FILE]
    if stale or (out / INDEX_FILE).exists():
        raise ValueError(
            f"export directory {str(out)!r} already holds other weights "
            f"({stale or [INDEX_FILE]}); export into an empty directory"
        )
    tensors = {name: _owned(t) for name, t in hf_sd.items()}
    _write_atomic(
        out / WEIGHTS_FILE, lambda p: save_file(tensors, str(p), metadata={"format": "pt"})
    )
    _write_atomic(out / "config.json", lambda p: p.write_text(json.dumps(hf_config, indent=2)))
    for name in copied:
        if (src / name).resolve() != (out / name).resolve():
            shutil.copyfile(src / name, out / name)
    logger.info("wrote HF checkpoint %s (%d tensors)", out, len(tensors))
    return out
