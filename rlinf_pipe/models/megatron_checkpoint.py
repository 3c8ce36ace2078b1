"""On-disk formats: the rlinf_pipe Megatron checkpoint folder and HF safetensors checkpoints.

A Megatron checkpoint folder (written by `rlinf-pipe convert --to megatron` and by the actor)::

    megatron.json                    {"format": "rlinf_pipe.megatron", "version": 1, "tp": T, "pp": P,
                                      "model_type": "qwen2"}
    COMPLETE                         written last (`rlinf_pipe.utils.folders`): a folder without it is incomplete
    model/tp{t:02d}_pp{p:03d}.safetensors   one file per (TP rank, PP rank): that rank's GPTModel state dict
    hf/                              the source HF folder's config.json, generation_config.json and tokenizer
                                     files (everything but weights), so the folder converts back to HF alone

Every file is written under a temporary name in its final folder and then renamed, so a reader never sees
a half-written file.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlinf_pipe.errors import CheckpointError  # (its home is rlinf_pipe.errors; still imported from here)
from rlinf_pipe.models.hf_config import WEIGHTS_FILE, WEIGHTS_INDEX, read_json, weight_files
from rlinf_pipe.utils.folders import COMPLETE, is_complete

MEGATRON_FORMAT = "rlinf_pipe.megatron"
MEGATRON_FORMAT_VERSION = 1
META_FILE = "megatron.json"
MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"
# Files of an HF folder that hold weights (never copied into `hf/`).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_WEIGHT_INDEX_SUFFIX = ".index.json"

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class MegatronMeta:
    """The contents of `megatron.json`, plus the folder it was read from."""

    tp: int
    pp: int
    model_type: str
    path: Path
    version: int = MEGATRON_FORMAT_VERSION

    @property
    def hf_dir(self) -> Path:
        """The `hf/` subfolder (config, generation config, tokenizer)."""
        return self.path / HF_SUBDIR


# --- atomic writes ----------------------------------------------------------------------------------------


def _atomic_target(path: Path) -> tuple[int, str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same folder and a rename."""
    path = Path(path)
    fd, tmp = _atomic_target(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_copy_file(src: PathLike, dst: PathLike) -> Path:
    """Copy `src` to `dst` through a temporary file in `dst`'s folder and a rename."""
    dst = Path(dst)
    fd, tmp = _atomic_target(dst)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dst


def save_safetensors(state: Mapping[str, torch.Tensor], path: PathLike, metadata: dict[str, str] | None = None) -> Path:
    """Save `state` (CPU copies, contiguous, no shared storage) to `path` atomically."""
    path = Path(path)
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}
    fd, tmp = _atomic_target(path)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt", **(metadata or {})})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_safetensors(path: PathLike) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, on CPU."""
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


# --- HF folders -------------------------------------------------------------------------------------------


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(_WEIGHT_INDEX_SUFFIX)


def hf_weight_files(hf_dir: PathLike) -> dict[str, Path]:
    """Map each tensor name of an HF checkpoint to its safetensors file, from the files transformers loads
    (`hf_config.weight_files`). Raises `CheckpointError` when the folder has no safetensors weights."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"{hf_dir} does not exist or is not a folder; pass a Hugging Face model folder")
    found = weight_files(hf_dir)
    if found is None:
        raise CheckpointError(
            f"{hf_dir} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}; save the model with "
            "`save_pretrained(..., safe_serialization=True)` first"
        )
    if found.shard_of is not None:
        return found.shard_of
    (file,) = found.files
    with safe_open(str(file), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), file)


class LazySafetensors(Mapping[str, torch.Tensor]):
    """A read-only mapping over an HF checkpoint's tensors that reads each tensor from disk when looked up,
    so a converter that needs one pipeline stage reads only that stage's weights."""

    def __init__(self, hf_dir: PathLike):
        self._files = hf_weight_files(hf_dir)

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._files[name]
        with safe_open(str(file), framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def copy_hf_side_files(src_dir: PathLike, dst_dir: PathLike) -> list[str]:
    """Copy every top-level non-weight file (config, generation config, tokenizer, chat template) of the HF
    folder `src_dir` into `dst_dir`; hidden files are skipped. Returns the copied names."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for file in sorted(src_dir.iterdir()):
        if file.is_file() and not file.name.startswith(".") and not _is_weight_file(file.name):
            atomic_copy_file(file, dst_dir / file.name)
            copied.append(file.name)
    return copied


def save_hf_safetensors(
    state: Mapping[str, torch.Tensor], out_dir: PathLike, max_shard_bytes: int = 4 << 30
) -> list[Path]:
    """Write an HF state dict as `model.safetensors`, or as `model-0000i-of-0000n.safetensors` shards plus
    `model.safetensors.index.json` when it exceeds `max_shard_bytes`. Tensors keep their order and dtype."""
    out_dir = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        return [save_safetensors(shards[0], out_dir / WEIGHTS_FILE)]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        paths.append(save_safetensors(shard, out_dir / file))
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(out_dir / WEIGHTS_INDEX, json.dumps(index, indent=2) + "\n")
    return paths


def read_hf_config_dict(hf_dir: PathLike) -> dict[str, Any]:
    """The raw `config.json` of an HF folder; `CheckpointError` when absent."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; pass a Hugging Face model folder")
    return read_json(path)


# --- Megatron folders -------------------------------------------------------------------------------------


def model_shard_path(ckpt_dir: PathLike, tp_rank: int, pp_rank: int) -> Path:
    """The safetensors file of rank (tp_rank, pp_rank) in a Megatron checkpoint folder."""
    return Path(ckpt_dir) / MODEL_SUBDIR / f"tp{tp_rank:02d}_pp{pp_rank:03d}.safetensors"


def save_model_shard(ckpt_dir: PathLike, tp_rank: int, pp_rank: int, state: Mapping[str, torch.Tensor]) -> Path:
    """Write one rank's GPTModel state dict (non-tensor entries such as `_extra_state` are dropped)."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")}
    return save_safetensors(tensors, model_shard_path(ckpt_dir, tp_rank, pp_rank))


def load_model_shard(ckpt_dir: PathLike, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """Read one rank's GPTModel state dict; `CheckpointError` when the file is missing."""
    path = model_shard_path(ckpt_dir, tp_rank, pp_rank)
    if not path.is_file():
        raise CheckpointError(f"Megatron checkpoint {ckpt_dir} is incomplete: {path} is missing")
    return load_safetensors(path)


def write_megatron_meta(out_dir: PathLike, tp: int, pp: int, hf_dir: PathLike) -> Path:
    """Copy `hf_dir`'s config / generation config / tokenizer files into `out_dir/hf/`, then write
    `out_dir/megatron.json`. Returns the json's path. The writer marks the folder complete once every shard is in
    (`rlinf_pipe.utils.folders.mark_complete`)."""
    out_dir = Path(out_dir)
    config = read_hf_config_dict(hf_dir)
    copy_hf_side_files(hf_dir, out_dir / HF_SUBDIR)
    meta = {
        "format": MEGATRON_FORMAT,
        "version": MEGATRON_FORMAT_VERSION,
        "tp": int(tp),
        "pp": int(pp),
        "model_type": config.get("model_type"),
    }
    return atomic_write_text(out_dir / META_FILE, json.dumps(meta, indent=2) + "\n")


def is_megatron_checkpoint(path: PathLike) -> bool:
    """Whether `path` is a complete folder holding a `megatron.json` (it may still fail `read_megatron_meta`'s
    checks)."""
    return is_complete(path) and (Path(path) / META_FILE).is_file()


def read_megatron_meta(ckpt_dir: PathLike) -> MegatronMeta:
    """Read and check `megatron.json`; `CheckpointError` names what is wrong."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} does not exist or is not a folder; pass a Megatron checkpoint folder")
    path = ckpt_dir / META_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a Megatron checkpoint (no {META_FILE}); pass a folder written by "
            "`rlinf-pipe convert --to megatron` or by the actor"
        )
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") != MEGATRON_FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, expected {MEGATRON_FORMAT!r}")
        if meta.get("version") != MEGATRON_FORMAT_VERSION:
            raise ValueError(f"version {meta.get('version')!r} is not supported (expected {MEGATRON_FORMAT_VERSION})")
        tp, pp = int(meta["tp"]), int(meta["pp"])
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        result = MegatronMeta(tp=tp, pp=pp, model_type=str(meta["model_type"]), path=ckpt_dir)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a valid rlinf_pipe Megatron checkpoint file: {exc}") from exc
    if not is_complete(ckpt_dir):
        raise CheckpointError(
            f"{ckpt_dir} is an incomplete Megatron checkpoint (no {COMPLETE} marker: its writer was interrupted); "
            "write it again"
        )
    return result
