"""ocria_rt: a C++/CUDA inference runtime for Qwen3.5-architecture document-parsing models."""

from __future__ import annotations

from pathlib import Path

from . import _core as _core
from .engine import Engine, GenerationResult
from .pipeline import Document, PageResult, parse
from .quantization import QuantizationResult, quantize
from .errors import (
    DependencyError,
    DeviceError,
    FileError,
    InternalError,
    InvalidArgumentError,
    ModelError,
    OcriaError,
    ResourceError,
)

__version__: str = _core.version()

_PACKAGE_DIR = Path(__file__).resolve().parent


def default_model_dir() -> Path:
    """The model that ships inside the package, used when no model is given: ocria-mini, a 9.3M-parameter
    Qwen3.5 VLM trained from scratch (scripts/train_ocr) to turn small synthdoc pages into Markdown."""
    return _PACKAGE_DIR / "models" / "ocria-mini"


def sample_document() -> Path:
    """A PDF shipped with the package for trying the default model: held-out synthdoc pages of its
    training distribution; ``sample.json`` beside it holds their true Markdown."""
    return _PACKAGE_DIR / "samples" / "sample.pdf"


def build_info() -> dict[str, object]:
    """Facts about this build: version, CUDA support, where the C++ SDK (headers, library) lives."""
    return {
        "version": __version__,
        "cuda": bool(_core.built_with_cuda()),
        "cuda_devices": int(_core.cuda_device_count()),
        "include_dir": str(_PACKAGE_DIR / "include"),
        "library_dir": str(_PACKAGE_DIR / "lib"),
        "cmake_dir": str(_PACKAGE_DIR / "lib" / "cmake" / "ocria_rt"),
        "default_model": str(default_model_dir()),
    }


__all__ = [
    "Engine",
    "GenerationResult",
    "Document",
    "PageResult",
    "parse",
    "quantize",
    "QuantizationResult",
    "OcriaError",
    "InvalidArgumentError",
    "FileError",
    "ModelError",
    "ResourceError",
    "DeviceError",
    "DependencyError",
    "InternalError",
    "build_info",
    "default_model_dir",
    "sample_document",
    "__version__",
]
