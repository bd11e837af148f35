"""Exceptions raised by ocria_rt. Every error the library reports derives from OcriaError."""


class OcriaError(Exception):
    """Base class of every ocria_rt error."""


class InvalidArgumentError(OcriaError, ValueError):
    """A bad argument: token id outside the vocabulary, prompt too long, bad sampling parameter."""


class FileError(OcriaError, OSError):
    """A missing, unreadable or malformed file (config.json, safetensors, tokenizer)."""


class ModelError(OcriaError):
    """The checkpoint does not describe a supported model (type, missing tensor, shape, dtype)."""


class ResourceError(OcriaError, MemoryError):
    """Memory or context capacity exhausted."""


class DeviceError(OcriaError, RuntimeError):
    """The accelerator is unavailable or its runtime failed (or CUDA support was not built)."""


class DependencyError(OcriaError, RuntimeError):
    """A package or resource the operation relies on is missing here or differs from the one it needs
    (e.g. the text source a model's held-out pages were generated with)."""


class InternalError(OcriaError, RuntimeError):
    """A bug in ocria_rt; please report it."""


__all__ = [
    "OcriaError",
    "InvalidArgumentError",
    "FileError",
    "ModelError",
    "ResourceError",
    "DeviceError",
    "DependencyError",
    "InternalError",
]
