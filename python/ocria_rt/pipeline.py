"""Documents to Markdown: PDFs and images, page by page, through a vision-language model.

>>> doc = ocria_rt.parse("report.pdf", pages="1-3")          # the model shipped in the package, CPU
>>> print(doc.markdown)                                       # "<!-- page 1 -->\\n...\\n\\n<!-- page 2 -->..."
>>> doc.pages[0].error, doc.pages[0].decode_ms, doc.timings["pages_per_s"]

Inputs: PDF files (rasterised with pypdfium2: the longer side of each page becomes `target_long_side`
pixels, or `dpi` when given), and image files Pillow reads (PNG, JPEG, TIFF, ...); every frame of a
multi-page TIFF is a page (other multi-frame images are read as their first frame). `pages` ("1-3,7", "5-": 1-based) selects pages
of every document; numbers past a document's end are ignored.

Each page is rendered and preprocessed (ocria_rt.preprocess) in a worker thread that runs ahead of the
model through a bounded queue; the model then reads the page image with the prompt (by default: the
page as Markdown, tables as HTML) through the model's chat template.

Failures:
- a page that fails (undecodable or truncated image data, a render failure, an image over the pixel
  limit, a prompt over the context limit) is recorded in its PageResult.error and the other pages go on;
- a whole input that cannot be read (missing path, a directory, neither a PDF nor an image, a PDF that
  does not parse, a zero-page PDF, a password-protected PDF, a page selection matching nothing) raises
  an ocria_rt.OcriaError naming the file when it is the only input. When several inputs are given it is
  recorded in Document.input_errors and the other inputs go on; if every input fails, the error is raised.
"""

from __future__ import annotations

import math
import os
import queue
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Union

import numpy as np

from .errors import FileError, InternalError, InvalidArgumentError, OcriaError
from .preprocess import DEFAULT_MAX_IMAGE_PIXELS, ImageProcessorConfig, decoder_error, preprocess_image

PathLike = Union[str, os.PathLike]

#: The instruction sent with every page unless `prompt` is given.
DEFAULT_PROMPT = (
    "Convert this page to Markdown. Keep the reading order, headings, lists and formulas (as LaTeX); "
    "write every table as an HTML <table>. Output only the content of the page."
)
DEFAULT_MAX_NEW_TOKENS = 2048
DEFAULT_TARGET_LONG_SIDE = 1288

_PDF_MAGIC = b"%PDF-"
# pdfium is not thread-safe: every call into it, from any thread, holds this lock.
_PDFIUM_LOCK = threading.Lock()


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #
@dataclass
class PageResult:
    """One page: its Markdown or its error, and where the time went."""

    source: str  # the input path, as given
    page_index: int  # 0-based index of the page in its document (page_number = page_index + 1)
    markdown: str | None  # None when the page failed
    error: str | None  # None when the page succeeded
    preprocess_ms: float = 0.0  # render / decode + preprocess_image (in the worker thread)
    prefill_ms: float = 0.0  # vision encoder + prompt prefill
    decode_ms: float = 0.0
    new_tokens: int = 0  # generated tokens (with the end token when the model stopped)
    tokens_per_s: float = 0.0  # decode throughput: (new_tokens - 1) / decode time
    prompt_tokens: int = 0  # text + image tokens of the prompt
    image_tokens: int = 0
    image_size: tuple[int, int] | None = None  # (width, height) of the rendered / decoded page
    finish_reason: str | None = None  # "stop" (end token) or "length" (max_new_tokens)
    # speculative decoding (an engine with a drafter): tokens per verify step (GenerationResult's)
    acceptance_lengths: list[int] = field(default_factory=list)
    # the class of the page's error: an OcriaError subclass ("FileError", "InvalidArgumentError", ...);
    # another name means an unexpected exception (a bug), recorded so that the other pages go on
    error_type: str | None = None

    @property
    def page_number(self) -> int:
        return self.page_index + 1

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class InputError:
    """An input that could not be read as a whole (recorded when several inputs are given)."""

    source: str
    error: str


@dataclass
class Document:
    """The result of parse(): pages in input order, their Markdown joined with page markers."""

    pages: list[PageResult]
    markdown: str
    timings: dict[str, float]
    prompt_tokens: int
    new_tokens: int
    sources: list[str] = field(default_factory=list)
    input_errors: list[InputError] = field(default_factory=list)
    model: str = ""
    device: str = ""

    @property
    def failed_pages(self) -> list[PageResult]:
        return [p for p in self.pages if p.error is not None]

    @property
    def ok(self) -> bool:
        """True when every page of every input succeeded."""
        return not self.input_errors and not self.failed_pages

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: per-page text, errors, timings and token counts."""
        pages = []
        for p in self.pages:
            d = asdict(p)
            d["page_number"] = p.page_number
            d["image_size"] = list(p.image_size) if p.image_size else None
            pages.append(d)
        return {
            "sources": list(self.sources),
            "model": self.model,
            "device": self.device,
            "pages": pages,
            "input_errors": [asdict(e) for e in self.input_errors],
            "markdown": self.markdown,
            "timings": dict(self.timings),
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "num_pages": len(self.pages),
            "num_failed_pages": len(self.failed_pages),
        }


# --------------------------------------------------------------------------- #
# Page selection
# --------------------------------------------------------------------------- #
_RANGE = re.compile(r"^\s*(\d+)?\s*(-)?\s*(\d+)?\s*$")


def parse_page_spec(spec: str | Iterable[int] | None) -> list[tuple[int, int | None]] | None:
    """ "1-3,7,10-" -> [(1, 3), (7, 7), (10, None)] (1-based, inclusive; None: to the end)."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        out: list[tuple[int, int | None]] = []
        for n in spec:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise InvalidArgumentError(f"page numbers are 1-based positive integers, got {n!r}")
            out.append((int(n), int(n)))
        if not out:
            raise InvalidArgumentError("the page selection is empty")
        return out
    ranges: list[tuple[int, int | None]] = []
    for part in spec.split(","):
        m = _RANGE.match(part)
        if not part.strip() or m is None or (m.group(1) is None and m.group(3) is None):
            raise InvalidArgumentError(f"bad page selection {spec!r}: expected e.g. '1-3,7' or '5-' (1-based)")
        lo = int(m.group(1)) if m.group(1) else 1
        hi = (int(m.group(3)) if m.group(3) else None) if m.group(2) else lo
        if lo < 1 or (hi is not None and hi < lo):
            raise InvalidArgumentError(f"bad page range {part.strip()!r} in {spec!r}: pages are 1-based, low <= high")
        ranges.append((lo, hi))
    return ranges


def select_pages(ranges: list[tuple[int, int | None]] | None, num_pages: int) -> list[int]:
    """0-based page indices (ascending, unique) of a document with num_pages pages."""
    if ranges is None:
        return list(range(num_pages))
    chosen: set[int] = set()
    for lo, hi in ranges:
        top = num_pages if hi is None else min(hi, num_pages)
        chosen.update(range(lo - 1, top))
    return sorted(chosen)


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #
@dataclass
class _Source:
    path: Path
    label: str
    kind: str  # "pdf" or "image"
    num_pages: int
    pages: list[int]
    page_error: OcriaError | None = None  # an image refused at open (too large): its one page fails with this


def _pdfium():
    try:
        import pypdfium2
    except ImportError as e:  # pragma: no cover - a dependency
        raise InvalidArgumentError("PDF input needs the pypdfium2 package (pip install pypdfium2)") from e
    return pypdfium2


def _open_pdf(path: Path):  # -> pypdfium2.PdfDocument; call with _PDFIUM_LOCK held
    pdfium = _pdfium()
    try:
        return pdfium.PdfDocument(str(path))
    except pdfium.PdfiumError as e:
        if getattr(e, "err_code", None) == pdfium.raw.FPDF_ERR_PASSWORD:
            raise FileError(f"'{path}' is a password-protected (encrypted) PDF: ocria_rt cannot open it") from e
        if getattr(e, "err_code", None) == pdfium.raw.FPDF_ERR_SUCCESS:
            # pdfium refuses a document whose page tree has no page without naming an error
            raise FileError(f"PDF '{path}' has no pages (pdfium finds no page in its page tree)") from e
        if getattr(e, "err_code", None) == pdfium.raw.FPDF_ERR_SECURITY:
            raise FileError(f"'{path}' uses an unsupported PDF security handler: ocria_rt cannot open it") from e
        raise FileError(f"cannot open PDF '{path}' (corrupt or not a PDF?): {e}") from e
    except Exception as e:  # noqa: BLE001 - OSError, or whatever else the binding raises
        raise decoder_error(e, f"cannot open PDF '{path}'") from e


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - a dependency
        raise InvalidArgumentError("image input needs the Pillow package (pip install Pillow)") from e
    return Image


def _open_image(path: Path):  # -> PIL.Image.Image (lazy: header only)
    Image = _pil()
    from PIL import UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return Image.open(path)
        except UnidentifiedImageError as e:
            raise FileError(
                f"'{path}' is neither a PDF nor an image file Pillow can read (PNG, JPEG, TIFF, ...)"
            ) from e
        except Image.DecompressionBombError:
            raise  # _inspect makes it the page's error
        except Exception as e:  # noqa: BLE001 - whatever the decoder raises on a corrupt file
            raise decoder_error(e, f"cannot open image '{path}'") from e


def _inspect(path: Path, ranges: list[tuple[int, int | None]] | None) -> _Source:
    """Checks an input as a whole and counts its pages; raises OcriaError naming the file."""
    label = str(path)
    if not path.exists():
        raise FileError(f"input '{path}' does not exist")
    if path.is_dir():
        raise FileError(f"input '{path}' is a directory, not a PDF or image file")
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
    except OSError as e:
        raise FileError(f"cannot read '{path}': {e.strerror or e}") from e
    if not head:
        raise FileError(f"input '{path}' is empty")

    page_error = None
    if _PDF_MAGIC in head:
        kind = "pdf"
        with _PDFIUM_LOCK:
            doc = _open_pdf(path)
            try:
                n = len(doc)
            finally:
                doc.close()
        if n == 0:
            raise FileError(f"PDF '{path}' has no pages")
    else:
        kind = "image"
        Image = _pil()
        try:
            im = _open_image(path)
        except Image.DecompressionBombError as e:
            # the file is an image, too large to decode: one page that fails
            n = 1
            page_error = InvalidArgumentError(f"image '{path}' is too large (Pillow's decompression-bomb guard): {e}")
        else:
            with im:
                try:
                    # the frames of a TIFF are pages; other multi-frame formats (MPO photos with a
                    # preview, animations) are read as their first frame
                    n = int(getattr(im, "n_frames", 1)) if im.format == "TIFF" else 1
                except Exception as e:  # noqa: BLE001
                    raise decoder_error(e, f"cannot count the pages (frames) of image '{path}'") from e
    pages = select_pages(ranges, n)
    if not pages:
        raise InvalidArgumentError(f"the page selection matches no page of '{path}' ({n} page{'s' * (n != 1)})")
    return _Source(path=path, label=label, kind=kind, num_pages=n, pages=pages, page_error=page_error)


# --------------------------------------------------------------------------- #
# Rendering and preprocessing (worker thread)
# --------------------------------------------------------------------------- #
@dataclass
class _Prepared:
    source: _Source
    page_index: int
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    image_size: tuple[int, int] | None = None
    preprocess_ms: float = 0.0
    error: BaseException | None = None


@dataclass
class _Options:
    cfg: ImageProcessorConfig
    dpi: float | None
    target_long_side: int
    max_image_pixels: int | None
    backend: str | None


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, OcriaError) else f"{type(e).__name__}: {e}"


def _render_pdf_page(doc, src: _Source, i: int, opt: _Options):  # -> PIL.Image
    where = f"page {i + 1} of '{src.path}'"
    with _PDFIUM_LOCK:
        try:
            page = doc[i]
        except Exception as e:  # noqa: BLE001 - PdfiumError, or whatever else the binding raises
            raise decoder_error(e, f"cannot load {where} (a broken page object?)") from e
        try:
            w, h = page.get_size()
            if not (w > 0 and h > 0):
                raise FileError(f"{where} has an empty size ({w} x {h} pt)")
            scale = opt.dpi / 72.0 if opt.dpi else opt.target_long_side / max(w, h)
            pw, ph = math.ceil(w * scale), math.ceil(h * scale)
            if opt.max_image_pixels is not None and pw * ph > opt.max_image_pixels:
                raise InvalidArgumentError(
                    f"{where} would render to {pw}x{ph} = {pw * ph} pixels, over the limit of "
                    f"{opt.max_image_pixels} (max_image_pixels); use a lower dpi"
                )
            bitmap = page.render(scale=scale)
            try:
                im = bitmap.to_pil()
                im = im.convert("RGB") if im.mode != "RGB" else im.copy()  # own the pixels
            finally:
                bitmap.close()
        except OcriaError:
            raise
        except Exception as e:  # noqa: BLE001 - PdfiumError, or whatever else the binding raises
            raise decoder_error(e, f"cannot render {where}") from e
        finally:
            page.close()
    return im


def _image_frame(im, src: _Source, i: int, opt: _Options):  # -> PIL.Image
    from PIL import ImageOps

    where = f"page {i + 1} of '{src.path}'" if src.num_pages > 1 else f"image '{src.path}'"
    try:
        im.seek(i)
    except Exception as e:  # noqa: BLE001 - whatever the decoder raises on a corrupt file
        raise decoder_error(e, f"cannot read {where}") from e
    w, h = im.size
    if opt.max_image_pixels is not None and w * h > opt.max_image_pixels:
        raise InvalidArgumentError(
            f"{where} is too large: {w}x{h} = {w * h} pixels, the limit is {opt.max_image_pixels} (max_image_pixels)"
        )
    try:
        im.load()
        frame = ImageOps.exif_transpose(im)  # as transformers' load_image does for files
    except Exception as e:  # noqa: BLE001
        raise decoder_error(e, f"cannot decode {where} (truncated or corrupt?)") from e
    return frame if frame is not im else im.copy()


def _pages_of(src: _Source, opt: _Options) -> Iterator[tuple[int, Any, float, str | None]]:
    """(page index, PIL image or None, seconds spent, exception) for the selected pages of one input."""
    if src.page_error is not None:
        for i in src.pages:
            yield i, None, 0.0, src.page_error
        return
    t0 = time.perf_counter()
    try:
        if src.kind == "pdf":
            with _PDFIUM_LOCK:
                handle = _open_pdf(src.path)
                try:
                    handle.init_forms()  # so that filled-in form fields are rendered
                except Exception:  # noqa: BLE001 - pages still render, without form fields
                    pass
        else:
            handle = _open_image(src.path)
    except Exception as e:  # noqa: BLE001 - the input changed since it was inspected
        for i in src.pages:
            yield i, None, 0.0, e
        return
    opened = time.perf_counter() - t0
    try:
        for i in src.pages:
            t0 = time.perf_counter()
            try:
                im = _render_pdf_page(handle, src, i, opt) if src.kind == "pdf" else _image_frame(handle, src, i, opt)
                yield i, im, time.perf_counter() - t0 + opened, None
            except Exception as e:  # noqa: BLE001 - recorded for this page
                yield i, None, time.perf_counter() - t0 + opened, e
            opened = 0.0
    finally:
        if src.kind == "pdf":
            with _PDFIUM_LOCK:
                handle.close()
        else:
            handle.close()


_DONE = object()


class _Producer(threading.Thread):
    """Renders and preprocesses pages ahead of the model; puts _Prepared items, then _DONE, in `out`."""

    def __init__(self, sources: list[_Source], opt: _Options, depth: int) -> None:
        super().__init__(name="ocria-rt-pages", daemon=True)
        self.sources, self.opt = sources, opt
        self.out: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            for src in self.sources:
                for i, im, seconds, error in _pages_of(src, self.opt):
                    item = _Prepared(source=src, page_index=i, error=error)
                    if im is not None:
                        t0 = time.perf_counter()
                        try:
                            item.image_size = (int(im.width), int(im.height))
                            item.pixel_values, item.image_grid_thw = preprocess_image(
                                im, self.opt.cfg, backend=self.opt.backend, max_image_pixels=self.opt.max_image_pixels
                            )
                        except Exception as e:  # noqa: BLE001 - recorded for this page
                            item.error = e
                        seconds += time.perf_counter() - t0
                    item.preprocess_ms = seconds * 1e3
                    if not self._put(item):
                        return
            self._put(_DONE)
        except BaseException as e:  # noqa: BLE001 - a bug: hand it to the consumer
            self._put(e)

    def items(self) -> Iterator[_Prepared]:
        while True:
            item = self.out.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise InternalError(f"the page worker failed: {_describe(item)}") from item
            yield item

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=10)


# --------------------------------------------------------------------------- #
# Progress
# --------------------------------------------------------------------------- #
class _Progress:
    def __init__(self, total: int, mode: bool | str, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = bool(getattr(self.stream, "isatty", lambda: False)())
        if mode not in (True, False, "always"):
            raise InvalidArgumentError(f"progress must be True, False or 'always', got {mode!r}")
        self.enabled = mode == "always" or (mode is True and isatty)
        self.tty = isatty
        self.total = total
        self.t0 = time.perf_counter()
        self.wrote = False

    def update(self, done: int, failed: int, new_tokens: int, model_seconds: float) -> None:
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        line = (
            f"ocria-rt: {done}/{self.total} pages"
            + (f" ({failed} failed)" if failed else "")
            + f" | {done / elapsed:.2f} pages/s | {new_tokens / model_seconds if model_seconds > 0 else 0.0:.1f} tokens/s"
        )
        self.stream.write(("\r" + line + "\x1b[K") if self.tty else line + "\n")
        self.stream.flush()
        self.wrote = True

    def close(self) -> None:
        if self.enabled and self.tty and self.wrote:
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------- #
# parse()
# --------------------------------------------------------------------------- #
def _comment(text: str) -> str:
    """Text made safe inside an HTML comment."""
    return " ".join(text.replace("--", "- -").split())


def _markdown(pages: list[PageResult], input_errors: list[InputError], labels: list[str]) -> str:
    multi = len(labels) > 1
    by_source: dict[str, list[str]] = {label: [] for label in labels}
    for p in pages:
        marker = f"<!-- {_comment(p.source)}: page {p.page_number} -->" if multi else f"<!-- page {p.page_number} -->"
        body = p.markdown if p.error is None else f"<!-- error: {_comment(p.error)} -->"
        by_source[p.source].append(f"{marker}\n{body}".rstrip())
    for e in input_errors:
        by_source[e.source].append(f"<!-- {_comment(e.source)}: error: {_comment(e.error)} -->")
    sections = [s for label in labels for s in by_source[label]]
    return "\n\n".join(sections) + ("\n" if sections else "")


def parse(
    path_or_paths: PathLike | Sequence[PathLike],
    engine: Any = None,
    prompt: str | None = None,
    pages: str | Iterable[int] | None = None,
    dpi: float | None = None,
    target_long_side: int = DEFAULT_TARGET_LONG_SIDE,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: bool | str = True,
    *,
    device: str = "cpu",
    temperature: float = 0.0,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    backend: str | None = None,
    queue_depth: int = 2,
    progress_stream: IO[str] | None = None,
) -> Document:
    """Converts PDFs and images to Markdown, page by page (see the module docstring).

    engine: an ocria_rt.Engine holding a VLM, a model directory (loaded on `device`), or None for the
    package's default model. prompt: the instruction for every page (default DEFAULT_PROMPT). pages: "1-3,7"
    (1-based, per document). dpi: render PDFs at this resolution instead of scaling their longer side to
    target_long_side pixels. progress: a progress line on stderr when it is a terminal; "always" forces it.
    max_image_pixels: pages larger than this (decoded or rendered) fail. backend: the resampler of
    preprocess_image ("torchvision" or "pil"; default: the model's image processor config).
    """
    from . import default_model_dir
    from .engine import Engine

    t_start = time.perf_counter()
    if isinstance(path_or_paths, (str, os.PathLike)):
        paths = [Path(path_or_paths)]
    else:
        paths = [Path(p) for p in path_or_paths]
    if not paths:
        raise InvalidArgumentError("parse() needs at least one input path")
    if dpi is not None and not (isinstance(dpi, (int, float)) and 0 < dpi <= 4800):
        raise InvalidArgumentError(f"dpi must be a number in (0, 4800], got {dpi!r}")
    if isinstance(target_long_side, bool) or not isinstance(target_long_side, int) or target_long_side < 1:
        raise InvalidArgumentError(f"target_long_side must be a positive integer, got {target_long_side!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidArgumentError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if progress not in (True, False, "always"):
        raise InvalidArgumentError(f"progress must be True, False or 'always', got {progress!r}")
    text_prompt = DEFAULT_PROMPT if prompt is None else str(prompt)
    ranges = parse_page_spec(pages)

    # 1. every input as a whole: fail early, before the model loads
    sources: list[_Source] = []
    input_errors: list[InputError] = []
    for p in paths:
        try:
            sources.append(_inspect(p, ranges))
        except OcriaError as e:
            if len(paths) == 1:
                raise
            input_errors.append(InputError(source=str(p), error=str(e)))
    if not sources:
        raise FileError("no input could be read: " + "; ".join(e.error for e in input_errors))

    # 2. the model's image settings, then pages start rendering while the model loads
    model_dir = Path(getattr(engine, "model_dir", engine) or default_model_dir())
    cfg = ImageProcessorConfig.from_model_dir(model_dir)
    opt = _Options(cfg=cfg, dpi=float(dpi) if dpi else None, target_long_side=target_long_side,
                   max_image_pixels=max_image_pixels, backend=backend)
    producer = _Producer(sources, opt, queue_depth)
    producer.start()
    results: list[PageResult] = []
    try:
        t_load = time.perf_counter()
        eng = engine if isinstance(engine, Engine) else Engine(model_dir, device=device)
        load_s = time.perf_counter() - t_load
        t_ready = time.perf_counter()
        if not eng.config.get("has_vision"):
            raise InvalidArgumentError(f"model '{eng.model_dir}' has no vision encoder: parse() needs a VLM")
        total = sum(len(s.pages) for s in sources)
        bar = _Progress(total, progress, progress_stream)
        model_s, new_tokens, prompt_tokens = 0.0, 0, 0
        for item in producer.items():
            page = _run_page(eng, item, text_prompt, max_new_tokens, temperature, cfg.merge_size)
            results.append(page)
            model_s += (page.prefill_ms + page.decode_ms) / 1e3
            new_tokens += page.new_tokens
            prompt_tokens += page.prompt_tokens
            bar.update(len(results), sum(1 for r in results if r.error), new_tokens, model_s)
        bar.close()
    finally:
        producer.close()

    wall = time.perf_counter() - t_start
    after_load = max(time.perf_counter() - t_ready, 1e-9)
    timings = {
        "wall_s": wall,
        "model_load_s": load_s,
        "preprocess_ms": sum(p.preprocess_ms for p in results),
        "prefill_ms": sum(p.prefill_ms for p in results),
        "decode_ms": sum(p.decode_ms for p in results),
        "pages_per_s": len(results) / after_load,
        "tokens_per_s": new_tokens / model_s if model_s > 0 else 0.0,
    }
    accepted = [a for p in results for a in p.acceptance_lengths]
    if accepted:  # tokens per verify step over all pages (tau)
        timings["mean_acceptance_length"] = sum(accepted) / len(accepted)
    labels = list(dict.fromkeys(str(p) for p in paths))  # input order, each once
    return Document(
        pages=results,
        markdown=_markdown(results, input_errors, labels),
        timings=timings,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        sources=[str(p) for p in paths],
        input_errors=input_errors,
        model=str(eng.model_dir),
        device=str(eng.device),
    )


def _run_page(eng: Any, item: _Prepared, prompt: str, max_new_tokens: int, temperature: float,
              merge_size: int) -> PageResult:
    page = PageResult(source=item.source.label, page_index=item.page_index, markdown=None, error=None,
                      preprocess_ms=item.preprocess_ms, image_size=item.image_size)
    if item.error is not None:
        page.error, page.error_type = _describe(item.error), type(item.error).__name__
        return page
    from .chat import build_multimodal_prompt

    messages = [{"role": "user", "content": [
        {"type": "image", "pixel_values": item.pixel_values, "image_grid_thw": item.image_grid_thw},
        {"type": "text", "text": prompt},
    ]}]
    try:
        ids, pv, grid = build_multimodal_prompt(eng, messages)
        page.prompt_tokens = len(ids)
        page.image_tokens = int(np.prod(np.asarray(grid))) // (merge_size * merge_size)
        room = eng.max_context - len(ids)
        if room < 1:
            raise InvalidArgumentError(
                f"page {item.page_index + 1} of '{item.source.path}' needs {len(ids)} prompt tokens, over the "
                f"model's context of {eng.max_context}"
            )
        r = eng.generate(ids, min(max_new_tokens, room), temperature=temperature, pixel_values=pv, image_grid_thw=grid)
    except OcriaError as e:
        page.error, page.error_type = str(e), type(e).__name__
        return page
    page.markdown = (r.text or "").strip()
    page.prefill_ms = r.prefill_seconds * 1e3
    page.decode_ms = r.decode_seconds * 1e3
    page.new_tokens = len(r.token_ids)
    page.tokens_per_s = r.decode_tokens_per_second
    page.finish_reason = r.finish_reason
    page.acceptance_lengths = list(r.acceptance_lengths)
    return page


__all__ = [
    "DEFAULT_PROMPT",
    "Document",
    "InputError",
    "PageResult",
    "parse",
    "parse_page_spec",
    "select_pages",
]
