"""Image preprocessing for Qwen3.5 vision-language models: page image -> (pixel_values, image_grid_thw).

The output is what transformers 5.17 feeds the vision encoder of a Qwen3.5 checkpoint. Its
``AutoImageProcessor`` for ``model_type == "qwen3_5"`` is ``Qwen2VLImageProcessor`` (the torchvision
backend) where torchvision is installed, else ``Qwen2VLImageProcessorPil`` (PIL + numpy). The two
differ only in the bicubic resize of the uint8 image:

- ``backend="torchvision"`` (the default, as in transformers with torchvision installed): torch's CPU
  antialiased bicubic on uint8 (``F.interpolate(..., mode="bicubic", antialias=True)``), reimplemented
  here in numpy with the same integer arithmetic (int16 weights with a per-axis fixed-point precision,
  horizontal pass first, intermediate rounded and clipped to uint8): bit-exact with torch on CPU;
- ``backend="pil"``: Pillow's ``Image.resize(..., BICUBIC)``, which is the PIL backend itself.

Both use the same filter (Keys cubic, a = -0.5, support widened by the downscale factor) and round
the intermediate image to uint8, but their fixed-point weights differ (torch: int16, Pillow: 22 bits)
and Pillow sometimes runs the vertical pass first, so the two backends' resized pixels differ by
1-2 levels on < 1 % of pixels, and by up to ~40 levels on ~20 % of pixels of sharp synthetic content
when Pillow picks the other pass order (the intermediate clipping then differs).

For a file path both backends here decode with Pillow (+ EXIF transpose, as the PIL backend does);
transformers' torchvision backend decodes paths with ``torchvision.io.decode_image`` instead (identical
pixels for PNG; JPEG decoders may differ by rounding, and it applies no EXIF rotation). Give a
``PIL.Image`` or an array to stay independent of the decoder.

Pipeline, per image:

1. load: a path is opened with Pillow, EXIF-transposed and converted to RGB (transformers'
   ``load_image``); a ``PIL.Image`` is converted to RGB (no EXIF transpose, as transformers does);
   a numpy ``HxW`` / ``HxWxC`` uint8 array (C = 1, 3 or 4; always channels-last) goes through
   ``PIL.Image.fromarray(...).convert("RGB")``;
2. ``smart_resize``: both sides become multiples of ``patch_size * merge_size``, the pixel count is
   kept within ``[min_pixels, max_pixels]`` and the aspect ratio close to the original;
3. resize the uint8 RGB image with the chosen backend's antialiased bicubic (skipped when the size
   is already right);
4. rescale and normalise in float32, with each backend's own operation order (the PIL backend:
   ``float32(float64(x) * rescale_factor)`` then ``(x - mean) / std``; torchvision: ``(x - mean/rf) /
   (std/rf)``; the two differ by at most 2.4e-7);
5. patchify: the image is cut into ``patch_size`` squares; patches are ordered merge window by merge
   window (``merge_size x merge_size`` patches, row-major inside the window, windows row-major over
   the image); each patch is repeated ``temporal_patch_size`` times along time and flattened as
   ``[C, T, patch, patch]``.

Configuration comes from the model directory: ``processor_config.json``'s ``"image_processor"`` entry
if present, else ``preprocessor_config.json``, with transformers' class defaults for missing keys.

Runtime dependencies: numpy and Pillow (no torch).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

import numpy as np

from .errors import FileError, InvalidArgumentError, ModelError, OcriaError, ResourceError

try:  # Pillow is a runtime dependency of image input; fail with a clear message where it is missing
    from PIL import Image, ImageOps, UnidentifiedImageError
except ImportError:  # pragma: no cover - exercised only without Pillow
    Image = None  # type: ignore[assignment]

# transformers.image_utils.OPENAI_CLIP_MEAN / OPENAI_CLIP_STD: the class defaults of Qwen2VLImageProcessor.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

#: Images with more pixels than this are refused before they are decoded (a "decompression bomb"
#: guard). Pass ``max_image_pixels=`` to change it per call. Pillow's own guard
#: (``2 * PIL.Image.MAX_IMAGE_PIXELS``, about 179 M pixels by default) also applies to encoded files.
DEFAULT_MAX_IMAGE_PIXELS = 2**28

#: smart_resize refuses images whose longer side is more than this many times the shorter one.
MAX_ASPECT_RATIO = 200

#: Bounds on the patch geometry of an image processor config, far above any real model (Qwen3.5:
#: 16, 2, 2). Every patch is repeated temporal_patch_size times in pixel_values.
MAX_PATCH_SIZE = 1024
MAX_TEMPORAL_PATCH_SIZE = 16
MAX_MERGE_SIZE = 64

ImageLike = Union[str, os.PathLike, "Image.Image", np.ndarray]


def _require_pillow() -> None:
    if Image is None:
        raise InvalidArgumentError(
            "image input needs the Pillow package (pip install Pillow), which is not installed"
        )


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class ImageProcessorConfig:
    """The preprocessing parameters; defaults are transformers' ``Qwen2VLImageProcessor`` class defaults.

    Qwen3.5 checkpoints override several of them in ``preprocessor_config.json`` (patch_size 16,
    image_mean/std 0.5, and the pixel range), so always build this from the model directory.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    backend: str = "torchvision"  # which transformers backend to reproduce: "torchvision" or "pil"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def factor(self) -> int:
        """Both resized sides are multiples of this: one merge window in pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one row of ``pixel_values``: C * T * patch * patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "image processor config") -> "ImageProcessorConfig":
        """Read a ``preprocessor_config.json`` dict with transformers' precedence rules.

        The pixel range: top-level ``min_pixels`` / ``max_pixels`` win over
        ``size.shortest_edge`` / ``size.longest_edge`` (transformers' backward-compatibility rule),
        which win over ``size.min_pixels`` / ``size.max_pixels``, then the class defaults.
        """
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"{source}: expected a JSON object, got {type(d).__name__}")
        base = cls()
        kw: dict[str, Any] = {}

        def bad(key: str, expected: str, v: Any) -> InvalidArgumentError:
            return InvalidArgumentError(f"{source}: key '{key}' must be {expected}, got {v!r}")

        def is_number(v: Any) -> bool:  # finite; a JSON integer may have any number of digits
            return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v)

        def positive_int(key: str, v: Any, limit: int) -> int:
            if not is_number(v) or int(v) != v or not 1 <= v <= limit:
                raise bad(key, f"an integer in [1, {limit}]" if limit < 2**62 else "a positive integer below 2**62", v)
            return int(v)

        def get_int(key: str, default: int, limit: int) -> int:
            v = d.get(key)
            return default if v is None else positive_int(key, v, limit)

        def get_bool(key: str, default: bool) -> bool:
            v = d.get(key)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise bad(key, "true or false", v)
            return v

        kw["patch_size"] = get_int("patch_size", base.patch_size, MAX_PATCH_SIZE)
        kw["temporal_patch_size"] = get_int("temporal_patch_size", base.temporal_patch_size, MAX_TEMPORAL_PATCH_SIZE)
        kw["merge_size"] = get_int("merge_size", base.merge_size, MAX_MERGE_SIZE)

        size = d.get("size")
        min_px: tuple[str, Any] = ("min_pixels", base.min_pixels)
        max_px: tuple[str, Any] = ("max_pixels", base.max_pixels)
        if size is not None:
            if not isinstance(size, dict):
                raise InvalidArgumentError(
                    f"{source}: key 'size' must be an object with 'shortest_edge' and 'longest_edge' "
                    f"(pixel counts), got {size!r}"
                )
            for key in ("min_pixels", "shortest_edge"):  # shortest_edge wins
                if size.get(key) is not None:
                    min_px = (f"size.{key}", size[key])
            for key in ("max_pixels", "longest_edge"):
                if size.get(key) is not None:
                    max_px = (f"size.{key}", size[key])
        if d.get("min_pixels") is not None:
            min_px = ("min_pixels", d["min_pixels"])
        if d.get("max_pixels") is not None:
            max_px = ("max_pixels", d["max_pixels"])
        kw["min_pixels"] = positive_int(*min_px, 2**62)
        if is_number(max_px[1]) and max_px[1] > 2**62:  # a huge upper bound means no limit
            max_px = (max_px[0], 2**62)
        kw["max_pixels"] = positive_int(*max_px, 2**62)
        if kw["min_pixels"] > kw["max_pixels"]:
            raise InvalidArgumentError(
                f"{source}: min_pixels ({kw['min_pixels']}, key '{min_px[0]}') is larger than max_pixels "
                f"({kw['max_pixels']}, key '{max_px[0]}')"
            )

        kw["do_resize"] = get_bool("do_resize", base.do_resize)
        kw["do_rescale"] = get_bool("do_rescale", base.do_rescale)
        kw["do_normalize"] = get_bool("do_normalize", base.do_normalize)
        kw["do_convert_rgb"] = get_bool("do_convert_rgb", base.do_convert_rgb)
        rf = d.get("rescale_factor")
        if rf is not None and not (is_number(rf) and rf > 0):
            raise bad("rescale_factor", "a finite number > 0", rf)
        kw["rescale_factor"] = base.rescale_factor if rf is None else float(rf)

        for key in ("image_mean", "image_std"):
            v = d.get(key)
            if v is None:
                kw[key] = getattr(base, key)
            elif is_number(v):
                kw[key] = (float(v),) * 3
            elif isinstance(v, (list, tuple)) and len(v) == 3 and all(is_number(x) for x in v):
                kw[key] = tuple(float(x) for x in v)
            else:
                raise bad(key, "a finite number or a list of 3 finite numbers", v)
        if any(s == 0 for s in kw["image_std"]):
            raise InvalidArgumentError(f"{source}: key 'image_std' must not contain 0, got {kw['image_std']}")

        resample = d.get("resample")
        if resample is not None and (isinstance(resample, bool) or resample != 3):
            # transformers would use another PIL filter; we only implement (and test) bicubic.
            raise InvalidArgumentError(
                f"{source}: resample={resample!r} is not supported (only 3 = bicubic, the Qwen2-VL default)"
            )
        backend = d.get("backend")
        if backend is not None:
            kw["backend"] = _check_backend(backend, source)
        kw["extra"] = dict(d)
        cfg = cls(**kw)
        cfg._check_pixel_range(source)
        return cfg

    def _check_pixel_range(self, source: str) -> None:
        """The float32 pixels of both backends must stay finite for every uint8 input: with them the
        rescale factor, mean and std (a tiny std or factor overflows float32)."""
        extremes = np.array([[[0, 0, 0], [255, 255, 255]]], dtype=np.uint8)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            finite = all(np.isfinite(_to_float(extremes, self, b)).all() for b in BACKENDS)
        if not finite:
            raise InvalidArgumentError(
                f"{source}: rescale_factor {self.rescale_factor}, image_mean {list(self.image_mean)} and "
                f"image_std {list(self.image_std)} turn some pixel values into inf or NaN in float32"
            )

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "ImageProcessorConfig":
        """Load from a checkpoint directory (or directly from a JSON file).

        Reads ``processor_config.json["image_processor"]`` if present, else ``preprocessor_config.json``
        (transformers' order); a directory with neither gives the class defaults. When the directory also
        holds a ``config.json`` with a ``vision_config``, the patch geometry must agree with it.
        """
        path = Path(model_dir)
        if path.is_file():
            return cls.from_dict(_read_json(path), source=f"'{path}'")
        if not path.is_dir():
            raise FileError(f"model directory '{path}' does not exist")
        cfg: ImageProcessorConfig | None = None
        proc = path / "processor_config.json"
        if proc.is_file():
            pd = _read_json(proc)
            if isinstance(pd, dict) and isinstance(pd.get("image_processor"), dict):
                cfg = cls.from_dict(pd["image_processor"], source=f"'{proc}' (image_processor)")
        if cfg is None:
            pre = path / "preprocessor_config.json"
            cfg = cls.from_dict(_read_json(pre), source=f"'{pre}'") if pre.is_file() else cls()
        cfg._check_against_model_config(path / "config.json")
        return cfg

    def _check_against_model_config(self, config_json: Path) -> None:
        if not config_json.is_file():
            return
        config = _read_json(config_json)
        if not isinstance(config, dict):
            raise ModelError(f"'{config_json}' must hold a JSON object, got {type(config).__name__}")
        vc = config.get("vision_config")
        if not isinstance(vc, dict):
            return
        pairs = (
            ("patch_size", "patch_size"),
            ("temporal_patch_size", "temporal_patch_size"),
            ("merge_size", "spatial_merge_size"),
        )
        for mine, theirs in pairs:
            v = vc.get(theirs)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ModelError(f"'{config_json}': key 'vision_config.{theirs}' must be an integer, got {v!r}")
            if v != getattr(self, mine):
                raise ModelError(
                    f"'{config_json}': key 'vision_config.{theirs}' is {v} but the image processor config "
                    f"says {mine} = {getattr(self, mine)}"
                )


BACKENDS = ("torchvision", "pil")


def _check_backend(backend: Any, source: str = "backend") -> str:
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"{source}: backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise FileError(f"cannot read '{path}': {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FileError(f"'{path}' is not valid JSON: {e}") from e


def load_config(model_dir_or_config: Any = None) -> ImageProcessorConfig:
    """None -> defaults; a directory or JSON file path; a dict (parsed JSON); or an ImageProcessorConfig."""
    if model_dir_or_config is None:
        return ImageProcessorConfig()
    if isinstance(model_dir_or_config, ImageProcessorConfig):
        return model_dir_or_config
    if isinstance(model_dir_or_config, dict):
        return ImageProcessorConfig.from_dict(model_dir_or_config)
    if isinstance(model_dir_or_config, (str, os.PathLike)):
        return ImageProcessorConfig.from_model_dir(model_dir_or_config)
    raise InvalidArgumentError(
        "model_dir_or_config must be None, a model directory, a JSON path, a dict or an "
        f"ImageProcessorConfig, got {type(model_dir_or_config).__name__}"
    )


# --------------------------------------------------------------------------- #
# Geometry
# --------------------------------------------------------------------------- #
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The target (height, width): multiples of ``factor``, area in [min_pixels, max_pixels], aspect kept.

    Same arithmetic as transformers' ``qwen2_vl`` ``smart_resize`` (Python ``round`` is round-half-even).
    """
    if height <= 0 or width <= 0:
        raise InvalidArgumentError(f"image has zero size ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidArgumentError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} is too extreme "
            f"({width}x{height}); it must be at most {MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid_thw_for_size(height: int, width: int, config: Any = None) -> tuple[int, int, int]:
    """The (t, h, w) patch grid an image of this size gets, without touching pixels."""
    cfg = load_config(config)
    if cfg.do_resize:
        height, width = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return 1, height // cfg.patch_size, width // cfg.patch_size


def num_image_tokens(image_grid_thw: Sequence[int], merge_size: int = 2) -> int:
    """How many image placeholder tokens (merged patches) an image with this grid takes in the prompt."""
    t, h, w = (int(x) for x in image_grid_thw)
    return t * h * w // (merge_size * merge_size)


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #
def _check_pixels(width: int, height: int, max_image_pixels: int | None, what: str) -> None:
    if width <= 0 or height <= 0:
        raise InvalidArgumentError(f"{what} has zero size ({width}x{height})")
    if max_image_pixels is not None and width * height > max_image_pixels:
        raise InvalidArgumentError(
            f"{what} is too large: {width}x{height} = {width * height} pixels, the limit is "
            f"{max_image_pixels} (max_image_pixels)"
        )


def decoder_error(e: Exception, message: str) -> OcriaError:
    """The OcriaError for an exception a decoder (Pillow, pdfium) raised: corrupt data shows up as
    OSError, SyntaxError, ValueError, but also TypeError, struct.error, IndexError, ... Ours pass
    through; out of memory is a ResourceError; anything else is a FileError: `message`, then the
    decoder's own words."""
    if isinstance(e, OcriaError):
        return e
    if isinstance(e, MemoryError):
        return ResourceError(f"{message}: out of memory")
    detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return FileError(f"{message}: {detail or type(e).__name__}" if isinstance(e, OSError)
                     else f"{message}: {type(e).__name__}: {detail}")


def _open_path(path: Path, max_image_pixels: int | None) -> "Image.Image":
    what = f"image '{path}'"
    if not path.exists():
        raise FileError(f"image file '{path}' does not exist")
    if path.is_dir():
        raise FileError(f"image path '{path}' is a directory, not an image file")
    try:
        with warnings.catch_warnings():
            # We apply our own size limit below; Pillow's warning threshold is lower than ours.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im: Image.Image = Image.open(path)
    except Image.DecompressionBombError as e:
        raise InvalidArgumentError(f"{what} is too large (Pillow's decompression-bomb guard): {e}") from e
    except UnidentifiedImageError as e:
        raise FileError(f"'{path}' is not an image file Pillow can read") from e
    except Exception as e:  # noqa: BLE001 - whatever the decoder raises on a corrupt file
        raise decoder_error(e, f"cannot open image '{path}'") from e
    _check_pixels(im.width, im.height, max_image_pixels, what)
    try:
        im.load()
        im = ImageOps.exif_transpose(im)  # as transformers' load_image does for paths
    except Exception as e:  # noqa: BLE001
        raise decoder_error(e, f"cannot decode image '{path}' (truncated or corrupt?)") from e
    return im


def _from_array(arr: np.ndarray) -> "Image.Image":
    if arr.dtype != np.uint8:
        raise InvalidArgumentError(
            f"a numpy image must be uint8 (HxW or HxWxC, channels last), got dtype {arr.dtype}"
        )
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))):
        raise InvalidArgumentError(
            f"a numpy image must be HxW, HxWx1, HxWx3 or HxWx4 (channels last), got shape {arr.shape}"
        )
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InvalidArgumentError(f"image has zero size (numpy shape {arr.shape})")
    return Image.fromarray(np.ascontiguousarray(arr))


def load_image(image: ImageLike, max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> "Image.Image":
    """A decoded RGB ``PIL.Image`` from a path, a PIL image or a uint8 numpy array."""
    _require_pillow()
    if isinstance(image, (str, os.PathLike)):
        im = _open_path(Path(image), max_image_pixels)
    elif isinstance(image, Image.Image):
        im = image
        _check_pixels(im.width, im.height, max_image_pixels, "image")
    elif isinstance(image, np.ndarray):
        if image.ndim >= 2:
            _check_pixels(image.shape[1], image.shape[0], max_image_pixels, "image")
        im = _from_array(image)
    else:
        raise InvalidArgumentError(
            f"image must be a file path, a PIL.Image or a uint8 numpy array, got {type(image).__name__}"
        )
    if im.mode != "RGB":
        try:
            im = im.convert("RGB")
        except Exception as e:  # noqa: BLE001 - a lazily decoded image can fail here
            raise decoder_error(e, f"cannot convert a mode '{im.mode}' image to RGB") from e
    return im


# --------------------------------------------------------------------------- #
# Resampling
# --------------------------------------------------------------------------- #
def _cubic_a05(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel with a = -0.5 (the antialiasing filter of torch and Pillow)."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _aa_bicubic_int16_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output index: first input index, int16 fixed-point weights [out, taps], precision bits.

    torch's ``_compute_indices_int16_weights_aa`` (CPU, uint8): float64 weights of the filter
    stretched by the downscale factor, normalised to sum 1, then scaled by 2**precision where the
    precision is the largest (< 22) that keeps the largest weight below 2**15, rounded half away
    from zero.
    """
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    taps = int(math.ceil(support)) * 2 + 1
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    # C++ casts truncate toward zero; center - support + 0.5 can be negative, then clamped to 0
    xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    xsize = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - xmin
    j = np.arange(taps)
    w = _cubic_a05((j[None, :] + xmin[:, None] - center[:, None] + 0.5) * invscale)
    w = np.where(j[None, :] < xsize[:, None], w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    w = np.where(total != 0.0, w / np.where(total != 0.0, total, 1.0), w)
    w_max = float(w.max())
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = w * float(1 << precision)
    wi = np.where(w < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int32)
    return xmin, wi, precision


def _resample_axis0_uint8(x: np.ndarray, out_size: int) -> np.ndarray:
    """One separable pass along axis 0 of a uint8 array, with torch's integer arithmetic."""
    in_size = x.shape[0]
    xmin, wi, precision = _aa_bicubic_int16_weights(in_size, out_size)
    acc = np.full((out_size,) + x.shape[1:], 1 << (precision - 1), dtype=np.int32)
    bshape = (out_size,) + (1,) * (x.ndim - 1)
    for k in range(wi.shape[1]):
        wk = wi[:, k]
        if not wk.any():
            continue
        # taps past the end have weight 0; clamp their index so the gather stays in bounds
        idx = np.minimum(xmin + k, in_size - 1)
        acc += wk.reshape(bshape) * x[idx].astype(np.int32)
    return np.clip(acc >> precision, 0, 255).astype(np.uint8)


def resize_bicubic_torch(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """HxWxC uint8 -> height x width x C uint8, bit-exact with torch's CPU
    ``F.interpolate(uint8, mode="bicubic", antialias=True, align_corners=False)`` (what torchvision's
    ``resize`` runs for uint8 on CPU): horizontal pass first, the intermediate rounded and clipped to
    uint8, then the vertical pass."""
    x = rgb
    if width != x.shape[1]:
        x = np.ascontiguousarray(x.transpose(1, 0, 2))  # resample along axis 0: whole-row gathers
        x = _resample_axis0_uint8(x, width)
        x = np.ascontiguousarray(x.transpose(1, 0, 2))
    if height != x.shape[0]:
        x = _resample_axis0_uint8(x, height)
    return x


def resize_bicubic_pil(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """HxWx3 uint8 -> height x width x 3 uint8 with Pillow's BICUBIC (transformers' PIL backend)."""
    _require_pillow()
    if (height, width) == rgb.shape[:2]:
        return rgb
    im = Image.fromarray(np.ascontiguousarray(rgb))
    return np.asarray(im.resize((width, height), resample=Image.Resampling.BICUBIC), dtype=np.uint8)


# --------------------------------------------------------------------------- #
# Pixels
# --------------------------------------------------------------------------- #
def patchify(chw: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """``[C, H, W]`` float32 -> ``[grid_h * grid_w, C * T * patch * patch]`` in transformers' order."""
    c, h, w = chw.shape
    gh, gw = h // patch_size, w // patch_size
    if gh * patch_size != h or gw * patch_size != w or gh % merge_size or gw % merge_size:
        raise InvalidArgumentError(
            f"image size {w}x{h} is not a multiple of patch_size * merge_size = {patch_size * merge_size} "
            "(enable do_resize)"
        )
    x = chw.reshape(c, gh // merge_size, merge_size, patch_size, gw // merge_size, merge_size, patch_size)
    # -> [block_row, block_col, in_row, in_col, C, patch_row, patch_col]
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (temporal_patch_size,) + x.shape[5:])
    return np.ascontiguousarray(x.reshape(gh * gw, c * temporal_patch_size * patch_size * patch_size))


def _to_float(rgb: np.ndarray, cfg: ImageProcessorConfig, backend: str) -> np.ndarray:
    """uint8 HxWx3 -> float32 HxWx3 with the same float32 steps as the chosen transformers backend."""
    if backend == "pil":
        # PilBackend.rescale: float64 multiply, cast to float32; normalize: float32 (x - mean) / std
        x = rgb
        if cfg.do_rescale:
            x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
        if cfg.do_normalize:
            x = x.astype(np.float32, copy=False)
            x = (x - np.asarray(cfg.image_mean, dtype=np.float32)) / np.asarray(cfg.image_std, dtype=np.float32)
        return x.astype(np.float32, copy=False)
    # TorchvisionBackend.rescale_and_normalize: rescale folded into float32 mean / std
    x = rgb.astype(np.float32)
    if cfg.do_normalize:
        mean = np.asarray(cfg.image_mean, dtype=np.float32)
        std = np.asarray(cfg.image_std, dtype=np.float32)
        if cfg.do_rescale:
            inv = np.float32(1.0 / cfg.rescale_factor)
            mean, std = mean * inv, std * inv
        return (x - mean) / std
    if cfg.do_rescale:
        return x * np.float32(cfg.rescale_factor)
    return x


def preprocess_image(
    image: ImageLike,
    model_dir_or_config: Any = None,
    *,
    backend: str | None = None,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
) -> tuple[np.ndarray, np.ndarray]:
    """One image -> (``pixel_values`` float32 ``[N, 3*T*P*P]``, ``image_grid_thw`` int64 ``[1, 3]``).

    ``N = grid_h * grid_w`` patches; the prompt takes ``N / merge_size**2`` image tokens.
    ``backend`` ("torchvision" or "pil") overrides the config's choice of resampler.
    """
    cfg = load_config(model_dir_or_config)
    backend = cfg.backend if backend is None else _check_backend(backend)
    im = load_image(image, max_image_pixels=max_image_pixels)
    rgb = np.asarray(im, dtype=np.uint8)
    height, width = rgb.shape[:2]
    if cfg.do_resize:
        rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        # a config with a huge min_pixels or patch size must not upscale past the pixel guard either
        limit = None if max_image_pixels is None else max(max_image_pixels, DEFAULT_MAX_IMAGE_PIXELS)
        if limit is not None and rh * rw > limit:
            raise InvalidArgumentError(
                f"the image processor config (min_pixels {cfg.min_pixels}, patch_size * merge_size {cfg.factor}) "
                f"resizes a {width}x{height} image to {rw}x{rh} = {rw * rh} pixels, over the limit of {limit}"
            )
        if (rh, rw) != (height, width):
            resize = resize_bicubic_torch if backend == "torchvision" else resize_bicubic_pil
            rgb = resize(rgb, rh, rw)
    x = _to_float(rgb, cfg, backend)
    chw = np.ascontiguousarray(x.transpose(2, 0, 1))
    pixel_values = patchify(chw, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
    grid = np.array([[1, chw.shape[1] // cfg.patch_size, chw.shape[2] // cfg.patch_size]], dtype=np.int64)
    return pixel_values, grid


def preprocess_images(
    images: Iterable[ImageLike],
    model_dir_or_config: Any = None,
    *,
    backend: str | None = None,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
) -> tuple[np.ndarray, np.ndarray]:
    """Several images -> (concatenated ``pixel_values``, ``image_grid_thw`` ``[num_images, 3]``)."""
    if isinstance(images, (str, os.PathLike, np.ndarray)) or (Image is not None and isinstance(images, Image.Image)):
        raise InvalidArgumentError("preprocess_images takes a list of images; use preprocess_image for one")
    cfg = load_config(model_dir_or_config)
    pvs, grids = [], []
    for im in images:
        pv, g = preprocess_image(im, cfg, backend=backend, max_image_pixels=max_image_pixels)
        pvs.append(pv)
        grids.append(g)
    if not pvs:
        raise InvalidArgumentError("preprocess_images got an empty list of images")
    return np.concatenate(pvs, axis=0), np.concatenate(grids, axis=0)


__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageProcessorConfig",
    "image_grid_thw_for_size",
    "load_config",
    "load_image",
    "num_image_tokens",
    "patchify",
    "preprocess_image",
    "preprocess_images",
    "resize_bicubic_pil",
    "resize_bicubic_torch",
    "smart_resize",
]
