"""Chat prompts: the model's jinja chat template, and multimodal prompts with images.

``apply_chat_template`` renders a list of messages with the template the checkpoint ships, the way
transformers 5.17 does (a sandboxed jinja environment with ``trim_blocks`` / ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML, ``raise_exception`` and
``strftime_now``; the tokenizer's special tokens passed as variables). The template is looked up in
the model directory in transformers' order: ``chat_template.jinja``, then ``chat_template.json``, then
``tokenizer_config.json``'s ``"chat_template"`` (a string, or a list of named templates: "default").

``build_multimodal_prompt`` turns messages holding images into what ``Engine.generate`` takes: token ids
in which each image's single ``<|image_pad|>`` placeholder is expanded to ``t*h*w / merge**2`` copies
(exactly as transformers' Qwen3-VL / Qwen3.5 processor expands it), with the images' ``pixel_values``
and ``image_grid_thw`` from :mod:`ocria_rt.preprocess`.

A message is ``{"role": ..., "content": str | list[item]}``; an item is ``{"type": "text", "text": ...}``
or an image: ``{"type": "image", "image": X}`` where X is a file path, a ``PIL.Image``, a uint8 numpy
array or the bytes of an encoded image (``"path"``, ``"url"`` and OpenAI-style
``{"type": "image_url", "image_url": {"url": ...}}`` work too; URLs may be local paths, ``file://`` or
``data:`` URLs; ocria_rt does not fetch from the network). An image that is already preprocessed can
be given as ``{"type": "image", "pixel_values": ..., "image_grid_thw": ...}``.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from . import _core
from .errors import FileError, InvalidArgumentError, ModelError
from .preprocess import (DEFAULT_MAX_IMAGE_PIXELS, ImageProcessorConfig, _read_json, decoder_error,
                         num_image_tokens, preprocess_image)

Message = Mapping[str, Any]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# --------------------------------------------------------------------------- #
# Template lookup and rendering
# --------------------------------------------------------------------------- #
def _model_dir(model_dir_or_engine: Any) -> Path:
    d = getattr(model_dir_or_engine, "model_dir", model_dir_or_engine)
    if not isinstance(d, (str, os.PathLike)):
        raise InvalidArgumentError(
            f"expected a model directory or an Engine, got {type(model_dir_or_engine).__name__}"
        )
    return Path(d)


def _pick_template(value: Any, source: Path) -> str:
    """A template string from a "chat_template" value: a string or a list of {"name", "template"}."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t["name"]: t.get("template") for t in value if isinstance(t, dict) and isinstance(t.get("name"), str)}
        default = named.get("default")
        if isinstance(default, str):
            return default
        raise ModelError(f"{source}: 'chat_template' is a list without a template named 'default'")
    raise ModelError(f"{source}: 'chat_template' must be a string, got {type(value).__name__}")


def load_chat_template(model_dir_or_engine: Any) -> tuple[str, dict[str, str]]:
    """(template source, special-token variables) of a model directory."""
    d = _model_dir(model_dir_or_engine)
    if not d.is_dir():
        raise FileError(f"model directory '{d}' does not exist")
    tok_cfg_path = d / "tokenizer_config.json"
    tok_cfg = _read_json(tok_cfg_path) if tok_cfg_path.is_file() else {}
    if not isinstance(tok_cfg, dict):
        raise FileError(f"'{tok_cfg_path}' must hold a JSON object")
    special: dict[str, str] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        v = tok_cfg.get(key)
        if isinstance(v, dict):  # {"content": "<|im_end|>", ...}
            v = v.get("content")
        if isinstance(v, str):
            special[key] = v

    jinja_file, json_file = d / "chat_template.jinja", d / "chat_template.json"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), special
        except (OSError, UnicodeDecodeError) as e:
            raise FileError(f"cannot read '{jinja_file}': {e}") from e
    if json_file.is_file():
        data = _read_json(json_file)
        value = data.get("chat_template") if isinstance(data, dict) else data
        return _pick_template(value, json_file), special
    if "chat_template" in tok_cfg:
        return _pick_template(tok_cfg["chat_template"], tok_cfg_path), special
    raise ModelError(
        f"model directory '{d}' has no chat template (chat_template.jinja, chat_template.json or "
        "tokenizer_config.json 'chat_template')"
    )


@lru_cache(maxsize=16)
def _compile(template: str):  # -> jinja2.Template
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise InvalidArgumentError("chat templates need the jinja2 package (pip install jinja2)") from e

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelError(f"the chat template does not parse (line {e.lineno}): {e.message}") from e
    except Exception as e:  # noqa: BLE001 - a hostile template can fail the compiler otherwise (RecursionError)
        raise ModelError(f"the chat template does not compile: {type(e).__name__}: {e}") from e


def _check_messages(messages: Any) -> list[Message]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidArgumentError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise InvalidArgumentError(f"messages[{i}] must be a dict with 'role' and 'content' keys")
        c = m["content"]
        if not isinstance(c, str) and not (isinstance(c, Sequence) and all(isinstance(x, Mapping) for x in c)):
            raise InvalidArgumentError(f"messages[{i}]['content'] must be a string or a list of dicts")
    return list(messages)


def apply_chat_template(
    model_dir_or_engine: Any,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The prompt text of `messages` rendered with the model's chat template.

    Extra keyword arguments become template variables (e.g. ``enable_thinking=False``), as in
    transformers' ``apply_chat_template``.
    """
    template, special = load_chat_template(model_dir_or_engine)
    compiled = _compile(template)
    msgs = _check_messages(messages)
    variables = {**special, "tools": None, "documents": None, **template_kwargs}
    import jinja2

    try:
        return str(compiled.render(messages=msgs, add_generation_prompt=bool(add_generation_prompt),
                                             **variables))
    except jinja2.exceptions.TemplateError as e:
        raise InvalidArgumentError(f"the chat template refused the messages: {e}") from e
    except Exception as e:  # noqa: BLE001 - the template is model content: any failure in it is reported
        raise InvalidArgumentError(
            f"the chat template of '{_model_dir(model_dir_or_engine)}' failed on these messages "
            f"({type(e).__name__}: {e}); does it take this content format?"
        ) from e


# --------------------------------------------------------------------------- #
# Images in messages
# --------------------------------------------------------------------------- #
def _is_image_item(item: Mapping[str, Any]) -> bool:
    # the same test as Qwen-VL chat templates: a typed image item, or any item with an image key
    return item.get("type") == "image" or "image" in item or "image_url" in item


def _is_video_item(item: Mapping[str, Any]) -> bool:
    return item.get("type") == "video" or "video" in item


def image_items(messages: Sequence[Message]) -> list[Mapping[str, Any]]:
    """The image items of `messages`, in prompt order."""
    out = []
    for m in _check_messages(messages):
        if isinstance(m["content"], str):
            continue
        for item in m["content"]:
            if _is_video_item(item) and not _is_image_item(item):
                raise InvalidArgumentError("video input is not supported (only images)")
            if _is_image_item(item):
                out.append(item)
    return out


def _image_from_url(url: str) -> Any:
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise InvalidArgumentError("a data: URL image must be base64-encoded")
        try:
            return io.BytesIO(base64.b64decode(payload, validate=False))
        except ValueError as e:
            raise InvalidArgumentError(f"bad base64 in a data: URL image: {e}") from e
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    if parsed.scheme in ("http", "https", "ftp"):
        raise InvalidArgumentError(f"remote image URLs are not fetched by ocria_rt; download it first: {url}")
    return url  # a plain path


def _image_source(item: Mapping[str, Any]) -> Any:
    for key in ("image", "path", "url"):
        if item.get(key) is not None:
            src = item[key]
            break
    else:
        iu = item.get("image_url")
        src = iu.get("url") if isinstance(iu, Mapping) else iu
        if src is None:
            raise InvalidArgumentError(f"image item {dict(item)!r} names no image ('image', 'path', 'url' or 'image_url')")
    if isinstance(src, str) and (src.startswith(("data:", "file:", "http:", "https:", "ftp:"))):
        return _image_from_url(src)
    if isinstance(src, (bytes, bytearray)):
        return io.BytesIO(bytes(src))
    return src


def _preprocess_item(item: Mapping[str, Any], cfg: ImageProcessorConfig, backend: str | None,
                     max_image_pixels: int | None) -> tuple[np.ndarray, np.ndarray]:
    if "pixel_values" in item or "image_grid_thw" in item:
        pv = np.asarray(item.get("pixel_values"), dtype=np.float32)
        grid = np.asarray(item.get("image_grid_thw"), dtype=np.int64).reshape(-1, 3)
        if grid.shape[0] != 1 or pv.ndim != 2 or pv.shape[0] != int(np.prod(grid[0])):
            raise InvalidArgumentError(
                "a preprocessed image item needs pixel_values [t*h*w, dim] and image_grid_thw [1, 3] of one image"
            )
        return pv, grid
    src = _image_source(item)
    if isinstance(src, io.BytesIO):
        from PIL import Image, UnidentifiedImageError

        try:
            src = Image.open(src)
            src.load()
        except UnidentifiedImageError as e:
            raise InvalidArgumentError(f"the bytes of an image item are not an image Pillow can read: {e}") from e
        except Exception as e:  # noqa: BLE001 - whatever the decoder raises on corrupt bytes
            raise decoder_error(e, "the bytes of an image item cannot be decoded") from e
    return preprocess_image(src, cfg, backend=backend, max_image_pixels=max_image_pixels)


# --------------------------------------------------------------------------- #
# Placeholder expansion
# --------------------------------------------------------------------------- #
def vision_token_ids(model_dir_or_engine: Any) -> dict[str, int]:
    """image_token_id, vision_start_token_id, vision_end_token_id and spatial_merge_size of a VLM, from
    the config the core read and checked (an Engine's, or config.json of a model directory)."""
    config = getattr(model_dir_or_engine, "config", None)
    if not isinstance(config, dict):
        config = _core.load_config(str(_model_dir(model_dir_or_engine)))
    if not config.get("has_vision"):
        raise InvalidArgumentError(f"model '{_model_dir(model_dir_or_engine)}' has no vision encoder: it cannot take images")
    out = {"merge_size": int(config["vision"]["spatial_merge_size"])}
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id"):
        out[key] = int(config[key])
    return out


def expand_image_tokens(token_ids: Sequence[int], image_grid_thw: np.ndarray, image_token_id: int,
                        merge_size: int = 2) -> list[int]:
    """Replaces the i-th `image_token_id` of `token_ids` by t*h*w / merge_size**2 copies of itself (the
    i-th image's token count); the number of placeholders must equal the number of images."""
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != len(grids):
        raise InvalidArgumentError(
            f"the prompt has {len(positions)} image placeholder(s) but {len(grids)} image(s) were given"
        )
    out: list[int] = []
    start = 0
    for pos, g in zip(positions, grids):
        out.extend(token_ids[start:pos])
        out.extend([image_token_id] * num_image_tokens([int(x) for x in g], merge_size))
        start = pos + 1
    out.extend(token_ids[start:])
    return [int(t) for t in out]


def build_multimodal_prompt(
    engine: Any,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    backend: str | None = None,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    **template_kwargs: Any,
) -> tuple[list[int], np.ndarray | None, np.ndarray | None]:
    """(input_ids, pixel_values, image_grid_thw) for `messages`, as transformers' processor builds them.

    `engine` is an Engine (its tokenizer and model directory are used). The images of the messages are
    preprocessed in prompt order; pixel_values / image_grid_thw are None when there are none.
    """
    if getattr(engine, "tokenizer", None) is None:
        raise FileError(f"model directory '{_model_dir(engine)}' has no tokenizer.json: cannot build a chat prompt")
    items = image_items(messages)
    vt = vision_token_ids(engine) if items else {}
    text = apply_chat_template(engine, messages, add_generation_prompt, **template_kwargs)
    ids = list(engine.encode(text))
    if not items:
        return ids, None, None
    cfg = ImageProcessorConfig.from_model_dir(_model_dir(engine))
    pvs, grids = [], []
    for item in items:
        pv, grid = _preprocess_item(item, cfg, backend, max_image_pixels)
        pvs.append(pv)
        grids.append(grid)
    grid_thw = np.concatenate(grids, axis=0)
    expanded = expand_image_tokens(ids, grid_thw, vt["image_token_id"], vt["merge_size"])
    return expanded, np.concatenate(pvs, axis=0), grid_thw


__all__ = [
    "apply_chat_template",
    "build_multimodal_prompt",
    "expand_image_tokens",
    "image_items",
    "load_chat_template",
    "vision_token_ids",
]
