#!/usr/bin/env python3
"""Seeded fuzzing of the files a user hands ocria_rt.

Each case corrupts one input the way a hostile or unlucky user would, then runs it through the
public API:

  config        config.json / generation_config.json of a text checkpoint (tests/fixtures/text_tied):
                values replaced by wrong types, NaN, inf, huge, negative, zero, fractional; keys
                deleted or added; raw bytes flipped. Then Engine(dir).score(...) and generate(...).
  index         model.safetensors.index.json of a sharded checkpoint (text_untied_dkdv), likewise.
  vlm_config    config.json of a VLM (the package's tiny-vlm): text_config, vision_config, token ids.
                Then a chat prompt with an image is built and scored (build_multimodal_prompt, score).
  preprocessor  preprocessor_config.json of the VLM, then the same image prompt.
  tokenizer     tokenizer.json / tokenizer_config.json of the VLM, then the same image prompt, decode.
  safetensors   the header of model.safetensors: a tensor's dtype, shape or data_offsets rewritten,
                the header length changed, random bytes flipped in the header. Then score.
  truncate      one file of a checkpoint cut at a random offset, then its scenario.
  image         PNG / JPEG / TIFF bytes flipped, cut, spliced, header fields rewritten (CRCs fixed
                so that the decoder reads on), then ocria_rt.parse.
  pdf           PDF bytes flipped, cut, numbers and keywords rewritten, then ocria_rt.parse.

A case passes when it ends in success or in an OcriaError other than InternalError (for parse: every
failed page's error_type is such a class). It fails when the process dies (crash), runs past
--timeout (hang), raises any other exception (foreign; InternalError counts as one: it is a bug),
or scores logits that are not finite (nan).

Cases run in worker processes, a batch of one kind per worker. Kinds whose cases reach native
parsers of raw bytes (safetensors, truncate, image, pdf) run each case in a process of its own,
forked from the worker after its imports; the other kinds run in the worker itself, and when one of
those crashes the worker, the case is recorded and the rest of the batch goes on in a new worker.

    python scripts/fuzz_inputs.py --cases 10000 --seed 1 --jobs 2     # the long run
    python scripts/fuzz_inputs.py --kind pdf --seed 1 --case 17         # one case, here, with its traceback
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import resource
import select
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
TEXT_MODEL = REPO / "tests" / "fixtures" / "text_tied"
SHARDED_MODEL = REPO / "tests" / "fixtures" / "text_untied_dkdv"  # five shards and an index
IMAGES = REPO / "tests" / "fixtures" / "images"

PASSING = ("ok", "error")
FAILING = ("crash", "hang", "foreign", "internal", "nan")


# --------------------------------------------------------------------------- #
# Base inputs
# --------------------------------------------------------------------------- #
def _write_pdf(path: Path, objects: list[bytes]) -> None:
    """A PDF with objects 1..n (object 1 the catalog) and a correct cross-reference table."""
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path.write_bytes(bytes(out))


def _text_pdf(path: Path) -> None:
    """Two pages of text in a compressed content stream, with the standard Helvetica font."""
    pages = []
    objects: list[bytes] = [b"<< /Type /Catalog /Pages 2 0 R >>", b"",  # the page tree, filled in below
                            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    for text in (b"Invoice 42: total 17.50 EUR", b"| a | b |\n| 1 | 2 |"):
        content = zlib.compress(b"BT /F1 14 Tf 12 60 Td (" + text + b") Tj ET 0 0 1 rg 10 10 80 20 re f")
        objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(content) + content + b"\nendstream")
        contents = len(objects)
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 240 100] /Resources << /Font << /F1 3 0 R >> >> "
                       b"/Contents %d 0 R >>" % contents)
        pages.append(len(objects))
    objects[1] = b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % p for p in pages) + b"] /Count %d >>" % len(pages)
    _write_pdf(path, objects)


def prepare_bases(root: Path) -> None:
    """The unmutated inputs every case starts from, under root (a VLM with a small pixel range so that
    its cases stay fast, and the documents)."""
    import ocria_rt
    from PIL import Image

    vlm = root / "vlm"
    shutil.copytree(Path(ocria_rt.__file__).resolve().parent / "models" / "tiny-vlm", vlm)
    pre = json.loads((vlm / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": 1024, "longest_edge": 4096}
    (vlm / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    docs = root / "docs"
    docs.mkdir()
    for name in ("vis_a.png", "palette.png", "gray.png", "rgba.png"):
        shutil.copy(IMAGES / name, docs / name)
    a, b = Image.open(IMAGES / "vis_a.png").convert("RGB"), Image.open(IMAGES / "vis_b.png").convert("RGB")
    a.save(docs / "page.jpg", quality=80)
    a.save(docs / "progressive.jpg", quality=60, progressive=True)
    a.save(docs / "pages.tif", save_all=True, append_images=[b], compression="tiff_lzw")
    b.save(docs / "raw.tif", compression="raw")
    a.save(docs / "image.pdf", save_all=True, append_images=[b])
    _text_pdf(docs / "text.pdf")
    shutil.copy(ocria_rt.sample_document(), docs / "sample.pdf")


# --------------------------------------------------------------------------- #
# Mutations
# --------------------------------------------------------------------------- #
def _numbers(rng: random.Random, old: Any) -> Any:
    """A number of the right type but a bad value, or a value of the wrong type."""
    is_num = isinstance(old, (int, float)) and not isinstance(old, bool)
    group = rng.choice(["type", "nan", "inf", "huge", "negative", "zero", "fraction", "nudge", "random", "string"])
    if group == "type":
        return rng.choice(["x", "", True, False, None, [], {}, [1, 2], {"a": 1}, "16", "NaN", [None]])
    if group == "nan":
        return float("nan")
    if group == "inf":
        return rng.choice([float("inf"), float("-inf")])
    if group == "huge":
        return rng.choice([2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63, 2**64, 10**20, 1e300, 1.7e308, 1e-320])
    if group == "negative":
        return -abs(old) if is_num and old else rng.choice([-1, -2**31, -1e300, -0.5])
    if group == "zero":
        return rng.choice([0, 0.0, -0.0])
    if group == "fraction":
        return (old + 0.5) if is_num else 0.5
    if group == "nudge" and is_num:
        return rng.choice([old + 1, old - 1, old * 2, old // 2 if isinstance(old, int) else old / 2, old * 1000])
    if group == "string":
        return rng.choice(["\x00", "\udc80", "é" * 3, "a" * 5000, "\ufeffsilu", f"{old}x", "\u202e"])
    return rng.randint(-4, 5000)


def _replacement(rng: random.Random, old: Any) -> Any:
    if isinstance(old, list) and old and rng.random() < 0.6:
        new = list(old)
        op = rng.choice(["drop", "dup", "append", "shuffle", "poison"])
        if op == "drop":
            new.pop(rng.randrange(len(new)))
        elif op == "dup":
            new.insert(rng.randrange(len(new)), new[rng.randrange(len(new))])
        elif op == "append":
            new.append(_numbers(rng, new[-1]))
        elif op == "shuffle":
            rng.shuffle(new)
        else:
            i = rng.randrange(len(new))
            new[i] = _numbers(rng, new[i])
        return new
    if isinstance(old, str) and rng.random() < 0.5:
        return rng.choice([old.upper(), old[:-1], old + old, "", old.replace("_", "-"), "x" + old])
    return _numbers(rng, old)


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(path + (k,))
            out.extend(_paths(v, path + (k,)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append(path + (i,))
            out.extend(_paths(v, path + (i,)))
    return out


def _path_str(path: tuple) -> str:
    s = ""
    for p in path:
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s


def mutate_json(rng: random.Random, doc: Any, max_edits: int = 3) -> list[str]:
    """Edits doc in place (1 to max_edits edits); returns what was done. A path is drawn by depth first
    (a depth uniformly, then a node at it), so that a large vocabulary does not drown the structure."""
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, max_edits])):
        paths = _paths(doc)
        if not paths:
            break
        by_depth = collections.defaultdict(list)
        for p in paths:
            by_depth[len(p)].append(p)
        path = rng.choice(by_depth[rng.choice(sorted(by_depth))])
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        key = path[-1]
        r = rng.random()
        if r < 0.15:
            del parent[key]
            done.append(f"{_path_str(path)} deleted")
        elif r < 0.2 and isinstance(parent, dict):
            parent[key + "_extra"] = _numbers(rng, None)
            done.append(f"{_path_str(path)}_extra added")
        else:
            parent[key] = _replacement(rng, parent[key])
            done.append(f"{_path_str(path)} = {_short(parent[key])}")
    return done


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def dump_json(rng: random.Random, doc: Any) -> bytes:
    # surrogatepass: a lone surrogate becomes bytes that are not UTF-8, as a broken writer would leave them
    text = json.dumps(doc, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)
    return text.encode("utf-8", "surrogatepass")


def flip_bytes(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None) -> tuple[bytes, str]:
    """1-8 bytes in [lo, hi) set to random values (a third of them 0x00 / 0xff / 0x80 / a non-UTF-8 lead)."""
    hi = len(data) if hi is None else hi
    if hi <= lo:
        return data, "no byte to flip"
    out = bytearray(data)
    where = sorted(rng.randrange(lo, hi) for _ in range(rng.randint(1, 8)))
    for i in where:
        out[i] = rng.choice([0x00, 0xFF, 0x80, 0xC3, 0xED]) if rng.random() < 0.33 else rng.randrange(256)
    return bytes(out), f"bytes flipped at {where}"


def splice_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    n = len(data)
    a = rng.randrange(n)
    b = min(n, a + rng.choice([1, 4, 16, 256, 4096]))
    op = rng.choice(["cut", "delete", "duplicate", "zero", "interesting"])
    if op == "cut":
        return data[:a], f"cut at byte {a} of {n}"
    if op == "delete":
        return data[:a] + data[b:], f"bytes [{a}, {b}) deleted"
    if op == "duplicate":
        return data[:b] + data[a:b] + data[b:], f"bytes [{a}, {b}) duplicated"
    if op == "zero":
        return data[:a] + bytes(b - a) + data[b:], f"bytes [{a}, {b}) zeroed"
    v = rng.choice([0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000])
    packed = struct.pack(rng.choice([">I", "<I"]), v)[: rng.choice([1, 2, 4])]
    return data[:a] + packed + data[a + len(packed):], f"0x{packed.hex()} written at byte {a}"


def _png_chunks(data: bytes) -> list[tuple[int, bytes, int]]:
    """(offset, type, length) of each chunk of a PNG."""
    out, pos = [], 8
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        out.append((pos, data[pos + 4:pos + 8], length))
        pos += 12 + length
    return out


def mutate_png(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A field of a chunk rewritten, its CRC fixed so that the decoder reads on."""
    chunks = [c for c in _png_chunks(data) if c[0] + 12 + c[2] <= len(data)]
    pos, ctype, length = rng.choice(chunks)
    body = bytearray(data[pos + 8:pos + 8 + length])
    if ctype == b"IHDR":
        field_, off, fmt = rng.choice([("width", 0, ">I"), ("height", 4, ">I"), ("bit depth", 8, ">B"),
                                       ("colour type", 9, ">B"), ("interlace", 12, ">B")])
        v = rng.choice([0, 1, 2, 3, 4, 6, 7, 8, 16, 255] if fmt == ">B"
                       else [0, 1, 65535, 100000, 2**31 - 1, 2**32 - 1])
        struct.pack_into(fmt, body, off, v)
        what = f"IHDR {field_} = {v}"
    elif body:
        i = rng.randrange(len(body))
        body[i] = rng.randrange(256)
        what = f"{ctype.decode('latin-1')} byte {i} changed"
    else:
        return splice_bytes(rng, data)
    crc = struct.pack(">I", zlib.crc32(bytes(ctype) + bytes(body)) & 0xFFFFFFFF)
    return data[:pos + 8] + bytes(body) + crc + data[pos + 12 + length:], what + " (CRC fixed)"


def mutate_jpeg(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A field of the frame header (SOF) or a quantisation / Huffman table byte rewritten."""
    marks = [m.start() for m in re.finditer(rb"\xff[\xc0-\xc2\xc4\xdb\xda]", data)]
    if not marks:
        return splice_bytes(rng, data)
    pos = rng.choice(marks)
    out = bytearray(data)
    if data[pos + 1] in (0xC0, 0xC1, 0xC2):
        name, off, fmt = rng.choice([("precision", 4, ">B"), ("height", 5, ">H"), ("width", 7, ">H"),
                                     ("components", 9, ">B"), ("sampling", 11, ">B")])
        v = rng.choice([0, 1, 2, 3, 4, 0x11, 0x22, 0x44, 0xFF] if fmt == ">B" else [0, 1, 0xFFFF, 30000])
        struct.pack_into(fmt, out, pos + off, v)
        return bytes(out), f"SOF {name} = {v}"
    i = pos + 4 + rng.randrange(16)
    if i < len(out):
        out[i] = rng.randrange(256)
    return bytes(out), f"marker 0x{data[pos + 1]:02x} byte {i - pos} changed"


def mutate_tiff(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """An entry of the first IFD (tag, type, count or value) rewritten."""
    endian = "<" if data[:2] == b"II" else ">"
    (ifd,) = struct.unpack(endian + "I", data[4:8])
    if ifd + 2 > len(data):
        return splice_bytes(rng, data)
    (count,) = struct.unpack(endian + "H", data[ifd:ifd + 2])
    if count == 0:
        return splice_bytes(rng, data)
    entry = ifd + 2 + 12 * rng.randrange(count)
    if entry + 12 > len(data):
        return splice_bytes(rng, data)
    (tag,) = struct.unpack(endian + "H", data[entry:entry + 2])
    out = bytearray(data)
    name, off, fmt = rng.choice([("type", 2, "H"), ("count", 4, "I"), ("value", 8, "I"), ("value", 8, "H")])
    v = rng.choice([0, 1, 2, 3, 7, 12, 255, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF] if fmt == "I" else [0, 1, 3, 5, 13, 0xFFFF])
    struct.pack_into(endian + fmt, out, entry + off, v)
    return bytes(out), f"IFD tag {tag} {name} = {v}"


_PDF_NUMBER = re.compile(rb"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")
_PDF_WORDS = [b"obj", b"endobj", b"stream", b"endstream", b"xref", b"trailer", b"startxref", b"/Kids", b"/Count",
              b"/MediaBox", b"/Contents", b"/Length", b"/Filter", b"/Root", b"/Type", b"/Page", b"R"]


def mutate_pdf(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    op = rng.choice(["number", "number", "word", "flip", "splice"])
    if op == "number":
        found = list(_PDF_NUMBER.finditer(data))
        if found:
            m = rng.choice(found)
            v = rng.choice([b"0", b"-1", b"1", b"3.5", b"999999999", b"2147483648", b"-2147483649", b"1e30",
                            b"99999999999999999999", b"NaN", b"00", b"-0"])
            what = f"number {m.group().decode()} at byte {m.start()} -> {v.decode()}"
            return data[:m.start()] + v + data[m.end():], what
    if op == "word":
        word = rng.choice(_PDF_WORDS)
        found = [m.start() for m in re.finditer(re.escape(word), data)]
        if found:
            at = rng.choice(found)
            new = rng.choice([b"", b"/Foo", rng.choice(_PDF_WORDS), word + word])
            what = f"{word.decode()} at byte {at} -> {new.decode() or 'nothing'}"
            return data[:at] + new + data[at + len(word):], what
    if op == "flip":
        return flip_bytes(rng, data)
    return splice_bytes(rng, data)


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
@dataclass
class Prepared:
    what: str  # the mutation, for the report
    scenario: str  # "text", "vlm" or "parse"
    target: Path  # the model directory, or the document for parse


def _model_copy(src: Path, out: Path, changed: dict[str, bytes]) -> Path:
    """out/model: the files of src (symlinked), those in `changed` written instead."""
    d = out / "model"
    d.mkdir()
    for f in src.iterdir():
        if f.name in changed:
            (d / f.name).write_bytes(changed[f.name])
        elif f.is_file():
            (d / f.name).symlink_to(f.resolve())
    return d


def _json_case(rng: random.Random, src: Path, out: Path, files: list[str], scenario: str) -> Prepared:
    name = rng.choice(files)
    raw = (src / name).read_bytes()
    if rng.random() < 0.15:
        data, what = flip_bytes(rng, raw)
    else:
        doc = json.loads(raw)
        what = "; ".join(mutate_json(rng, doc)) or "unchanged"
        data = dump_json(rng, doc)
    return Prepared(f"{name}: {what}", scenario, _model_copy(src, out, {name: data}))


def case_config(rng, bases, out):
    return _json_case(rng, TEXT_MODEL, out, ["config.json"] * 4 + ["generation_config.json"], "text")


def case_index(rng, bases, out):
    return _json_case(rng, SHARDED_MODEL, out, ["model.safetensors.index.json"], "text")


def case_vlm_config(rng, bases, out):
    return _json_case(rng, bases / "vlm", out, ["config.json"], "vlm")


def case_preprocessor(rng, bases, out):
    return _json_case(rng, bases / "vlm", out, ["preprocessor_config.json"], "vlm")


def case_tokenizer(rng, bases, out):
    return _json_case(rng, bases / "vlm", out, ["tokenizer.json", "tokenizer.json", "tokenizer_config.json"], "vlm")


def case_safetensors(rng, bases, out):
    raw = (TEXT_MODEL / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    r = rng.random()
    if r < 0.25:
        new, what = flip_bytes(rng, raw, 0 if rng.random() < 0.1 else 8, 8 + n)
    elif r < 0.3:
        v = rng.choice([0, 1, n - 1, n + 1, n + 8, len(raw), 2**63, 2**64 - 1])
        new, what = struct.pack("<Q", v) + raw[8:], f"header length {n} -> {v}"
    else:
        name = rng.choice(sorted(k for k in header if k != "__metadata__"))
        t = header[name]
        part = rng.choice(["dtype", "shape", "data_offsets", "json"])
        if part == "dtype":
            t["dtype"] = rng.choice(["F32", "BF16", "F16", "F64", "I32", "I64", "I8", "U8", "BOOL", "F8_E4M3",
                                     "F8_E5M2", "F4", "", "f32", 32, None, ["F32"]])
            what = f"tensor '{name}' dtype = {_short(t['dtype'])}"
        elif part == "shape":
            s = list(t["shape"])
            op = rng.choice(["drop", "append", "reverse", "double", "zero", "negative", "huge", "fraction", "type"])
            i = rng.randrange(len(s)) if s else 0
            if op == "drop" and s:
                s.pop()
            elif op == "append":
                s.append(rng.choice([1, 2]))
            elif op == "reverse":
                s.reverse()
            elif s and op in ("double", "zero", "negative", "huge", "fraction"):
                s[i] = {"double": s[i] * 2, "zero": 0, "negative": -s[i], "fraction": s[i] + 0.5,
                        "huge": rng.choice([2**31, 2**40, 2**62, 2**64])}[op]
            else:
                s = rng.choice([None, "64", [[64]], {}])
            t["shape"] = s
            what = f"tensor '{name}' shape = {_short(s)}"
        elif part == "data_offsets":
            b, e = t["data_offsets"]
            others = [v["data_offsets"] for k, v in header.items() if k not in (name, "__metadata__")]
            k = rng.choice([1, 2, 4, e - b])
            t["data_offsets"] = rng.choice([[b + k, e + k], [b - k, e - k], [b, b], [e, b], list(rng.choice(others)),
                                            [0, 2**63], [-1, e], [b], [b, e, e], [str(b), e], [b + 0.5, e], None])
            what = f"tensor '{name}' data_offsets = {_short(t['data_offsets'])}"
        else:
            what = "; ".join(mutate_json(rng, header, 2))
        text = dump_json(rng, header)
        new = struct.pack("<Q", len(text)) + text + data
    return Prepared(f"model.safetensors: {what}", "text", _model_copy(TEXT_MODEL, out, {"model.safetensors": new}))


def case_truncate(rng, bases, out):
    src, name, scenario = rng.choice([
        (TEXT_MODEL, "model.safetensors", "text"), (TEXT_MODEL, "model.safetensors", "text"),
        (TEXT_MODEL, "config.json", "text"), (TEXT_MODEL, "generation_config.json", "text"),
        (bases / "vlm", "model.safetensors", "vlm"), (bases / "vlm", "tokenizer.json", "vlm"),
        (bases / "vlm", "tokenizer_config.json", "vlm"), (bases / "vlm", "preprocessor_config.json", "vlm"),
    ])
    raw = (src / name).read_bytes()
    if name.endswith(".safetensors") and rng.random() < 0.5:  # inside the length prefix or the header
        (n,) = struct.unpack("<Q", raw[:8])
        cut = rng.randrange(8 + n + 1)
    else:
        cut = rng.randrange(len(raw))
    return Prepared(f"{name} cut at byte {cut} of {len(raw)}", scenario, _model_copy(src, out, {name: raw[:cut]}))


def case_image(rng, bases, out):
    docs = bases / "docs"
    name = rng.choice(["vis_a.png", "palette.png", "gray.png", "rgba.png", "page.jpg", "progressive.jpg",
                       "pages.tif", "raw.tif"])
    data = (docs / name).read_bytes()
    r = rng.random()
    if r < 0.45:
        fmt = {"png": mutate_png, "jpg": mutate_jpeg, "tif": mutate_tiff}[name.rsplit(".", 1)[1]]
        new, what = fmt(rng, data)
    elif r < 0.75:
        new, what = flip_bytes(rng, data)
    else:
        new, what = splice_bytes(rng, data)
    path = out / name
    path.write_bytes(new)
    return Prepared(f"{name}: {what}", "parse", path)


def case_pdf(rng, bases, out):
    name = rng.choice(["text.pdf", "text.pdf", "image.pdf", "sample.pdf"])
    data = (bases / "docs" / name).read_bytes()
    new, what = mutate_pdf(rng, data)
    if rng.random() < 0.2:
        new, more = mutate_pdf(rng, new)
        what += "; " + more
    path = out / name
    path.write_bytes(new)
    return Prepared(f"{name}: {what}", "parse", path)


@dataclass(frozen=True)
class Kind:
    make: Callable[[random.Random, Path, Path], Prepared] | None  # (rng, bases, case directory) -> the case
    weight: float  # share of --cases
    isolate: bool  # each case in a process of its own (it reaches a native parser of raw bytes)


# The runner's own check: cases that end each way a case can end, in the worker itself and forked.
PROBE_BEHAVIOURS = ["ok", "error", "foreign", "internal", "nan", "crash", "ok", "hang", "ok"]


PROBE_KINDS: dict[str, Kind] = {
    "probe_inline": Kind(None, 0, False),  # case i behaves as PROBE_BEHAVIOURS[i]
    "probe_forked": Kind(None, 0, True),
}


def _prepare(kind: str, seed: int, index: int, bases: Path, out: Path) -> Prepared:
    if kind in PROBE_KINDS:
        behaviour = PROBE_BEHAVIOURS[index % len(PROBE_BEHAVIOURS)]
        return Prepared(f"probe: {behaviour}", "probe:" + behaviour, out)
    return KINDS[kind].make(random.Random(f"{seed}/{kind}/{index}"), bases, out)

KINDS: dict[str, Kind] = {
    "config": Kind(case_config, 3, False),
    "index": Kind(case_index, 1, False),
    "vlm_config": Kind(case_vlm_config, 2, False),
    "preprocessor": Kind(case_preprocessor, 1, False),
    "tokenizer": Kind(case_tokenizer, 1, False),
    "safetensors": Kind(case_safetensors, 3, True),
    "truncate": Kind(case_truncate, 2, True),
    "image": Kind(case_image, 2, True),
    "pdf": Kind(case_pdf, 2, True),
}
ALL_KINDS = {**KINDS, **PROBE_KINDS}


# --------------------------------------------------------------------------- #
# Scenarios and verdicts
# --------------------------------------------------------------------------- #
class NonFinite(Exception):
    """Scores that are not finite."""


_SCENARIO_STATE: dict[str, Any] = {}


def _image() -> Any:
    import numpy as np

    return np.random.default_rng(7).integers(0, 256, (40, 56, 3), dtype=np.uint8)


def _check_finite(logits: Any, what: str) -> None:
    import numpy as np

    if not np.all(np.isfinite(logits)):
        raise NonFinite(f"{what}: {int(np.sum(~np.isfinite(logits)))} of {logits.size} logits are not finite")


def run_scenario(p: Prepared, bases: Path) -> None:
    import numpy as np
    import ocria_rt
    from ocria_rt.chat import build_multimodal_prompt

    if p.scenario.startswith("probe:"):
        behaviour = p.scenario.split(":")[1]
        if behaviour == "error":
            raise ocria_rt.FileError("probe")
        if behaviour == "foreign":
            raise KeyError("probe")
        if behaviour == "internal":
            raise ocria_rt.InternalError("probe")
        if behaviour == "nan":
            _check_finite(np.array([1.0, np.nan]), "probe")
        if behaviour == "crash":
            os.abort()
        if behaviour == "hang":
            time.sleep(3600)
    elif p.scenario == "text":
        eng = ocria_rt.Engine(p.target, num_threads=1)
        ids = [1, 2, 3, 4, 5, 6, 7, 8]
        _check_finite(eng.score(ids), "score")
        eng.generate(ids, max_new_tokens=2)
    elif p.scenario == "vlm":
        eng = ocria_rt.Engine(p.target, num_threads=1, max_image_patches=256)
        msgs = [{"role": "user", "content": [{"type": "image", "image": _image()},
                                             {"type": "text", "text": "Convert this page to Markdown."}]}]
        ids, pv, grid = build_multimodal_prompt(eng, msgs)
        _check_finite(eng.score(ids, pixel_values=pv, image_grid_thw=grid), "score")
        eng.generate(ids, max_new_tokens=2, pixel_values=pv, image_grid_thw=grid)
        eng.decode(ids)
    else:
        doc = ocria_rt.parse([p.target], engine=parse_engine(bases), max_new_tokens=2, target_long_side=64,
                             pages="1-2", progress=False)
        for page in doc.pages:
            if page.error_type is not None:
                cls = getattr(ocria_rt.errors, page.error_type, None)
                ours = isinstance(cls, type) and issubclass(cls, ocria_rt.OcriaError)
                if not ours or cls is ocria_rt.InternalError:
                    raise RuntimeError(f"page {page.page_number} failed with {page.error_type}: {page.error}")


def parse_engine(bases: Path) -> Any:
    """The VLM that parse cases share, loaded once per worker (before its forks)."""
    import ocria_rt

    if "parse" not in _SCENARIO_STATE:
        _SCENARIO_STATE["parse"] = ocria_rt.Engine(bases / "vlm", num_threads=1, max_image_patches=256)
    return _SCENARIO_STATE["parse"]


def verdict(exc: BaseException | None) -> tuple[str, str]:
    """(outcome, detail) of a case that ended with `exc` (None: success)."""
    import ocria_rt

    if exc is None:
        return "ok", ""
    if isinstance(exc, NonFinite):
        return "nan", str(exc)
    if isinstance(exc, ocria_rt.InternalError):
        return "internal", str(exc)
    if isinstance(exc, ocria_rt.OcriaError):
        message = str(exc)
        if not message.strip():
            return "foreign", f"{type(exc).__name__} with an empty message"
        return "error", f"{type(exc).__name__}: {message}"[:500]
    return "foreign", f"{type(exc).__name__}: {exc}"[:500]


def describe_case(kind: str, seed: int, index: int, bases: Path, work: Path) -> str:
    """The mutation of a case, built again (for a case whose process died before it could report)."""
    out = Path(tempfile.mkdtemp(prefix=f"{kind}-{index}-", dir=work))
    try:
        return _prepare(kind, seed, index, bases, out).what
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_case(kind: str, seed: int, index: int, bases: Path, work: Path, verbose: bool = False) -> dict[str, Any]:
    """Builds and runs one case in this process; its result record."""
    out = Path(tempfile.mkdtemp(prefix=f"{kind}-{index}-", dir=work))
    what = "?"
    t0 = time.perf_counter()
    try:
        prepared = _prepare(kind, seed, index, bases, out)
        what = prepared.what
        if verbose:
            print(f"{kind} seed {seed} case {index}: {what}", flush=True)
        exc: BaseException | None = None
        try:
            run_scenario(prepared, bases)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - judged by verdict (pyo3 panics are BaseExceptions)
            exc = e
            if verbose:
                traceback.print_exc()
        outcome, detail = verdict(exc)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"kind": kind, "seed": seed, "index": index, "outcome": outcome, "detail": detail, "what": what,
            "seconds": round(time.perf_counter() - t0, 4)}


# --------------------------------------------------------------------------- #
# Worker: runs a batch, forking per case for isolated kinds
# --------------------------------------------------------------------------- #
def _run_forked(kind: str, seed: int, index: int, bases: Path, work: Path, timeout: float) -> dict[str, Any]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report, leave without cleanup handlers
        os.close(r)
        try:
            rec = run_case(kind, seed, index, bases, work)
            os.write(w, json.dumps(rec).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([r], [], [], max(left, 0))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return {"outcome": "hang", "detail": f"no result after {timeout:.0f} s"}
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if chunks:
        return json.loads(b"".join(chunks))
    if os.WIFSIGNALED(status):
        return {"outcome": "crash", "detail": f"killed by {signal.Signals(os.WTERMSIG(status)).name}"}
    return {"outcome": "crash", "detail": f"exited with status {os.WEXITSTATUS(status)} without a result"}


def worker_main(memory_limit_mb: int) -> None:
    job = json.loads(sys.stdin.read())
    results = os.dup(1)
    os.dup2(2, 1)  # anything else written to stdout (native libraries) goes to stderr
    sys.stdout = sys.stderr
    if memory_limit_mb > 0:  # an allocation past this fails (an error to report) instead of swapping
        limit = memory_limit_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import numpy  # noqa: F401 - imported before the forks, as every case needs them
    import ocria_rt  # noqa: F401
    import ocria_rt.chat  # noqa: F401
    import pypdfium2  # noqa: F401
    from PIL import Image  # noqa: F401

    bases, work = Path(job["bases"]), Path(job["work"])
    for kind, seed, index in job["cases"]:
        if ALL_KINDS[kind].isolate:
            if kind in ("image", "pdf"):
                parse_engine(bases)
            rec = _run_forked(kind, seed, index, bases, work, job["timeout"])
            if rec["outcome"] in ("crash", "hang"):
                rec.update(kind=kind, seed=seed, index=index, what=describe_case(kind, seed, index, bases, work))
        else:
            rec = run_case(kind, seed, index, bases, work)
        os.write(results, (json.dumps(rec) + "\n").encode())


# --------------------------------------------------------------------------- #
# Runner: worker processes over the batches, crashes and hangs recorded
# --------------------------------------------------------------------------- #
@dataclass
class _Worker:
    proc: subprocess.Popen
    cases: list
    stderr_path: Path
    done: int = 0
    buffer: bytes = b""
    deadline: float = 0.0


@dataclass
class Report:
    results: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r["outcome"] not in PASSING]

    def counts(self) -> dict[str, collections.Counter]:
        by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for r in self.results:
            by_kind[r["kind"]][r["outcome"]] += 1
        return by_kind

    def summary(self) -> str:
        cols = PASSING + FAILING
        lines = [f"{'kind':<13}" + "".join(f"{c:>9}" for c in ("cases",) + cols)]
        counts = self.counts()
        total: collections.Counter = collections.Counter()
        for kind in ALL_KINDS:
            if kind in counts:
                c = counts[kind]
                total.update(c)
                lines.append(f"{kind:<13}" + f"{sum(c.values()):>9}" + "".join(f"{c[o]:>9}" for o in cols))
        lines.append(f"{'all':<13}" + f"{sum(total.values()):>9}" + "".join(f"{total[o]:>9}" for o in cols))
        errors = collections.Counter(r["detail"].split(":")[0] for r in self.results if r["outcome"] == "error")
        lines.append("errors by class: " + ", ".join(f"{k} {v}" for k, v in errors.most_common()))
        lines.append(f"wall time {self.wall_s:.1f} s")
        for r in self.failures:
            lines.append(f"FAIL {r['outcome']}: {r['kind']} seed {r['seed']} case {r['index']}: {r['what']}\n"
                         f"     {r['detail']}\n     reproduce: python scripts/fuzz_inputs.py --kind {r['kind']} "
                         f"--seed {r['seed']} --case {r['index']}")
        return "\n".join(lines)


def plan(cases: int, seed: int, kinds: list[str] | None = None) -> list[tuple[str, int, int]]:
    """`cases` cases (at least one per kind) shared among the kinds by weight, largest remainders first."""
    names = kinds or list(KINDS)
    total = sum(KINDS[k].weight for k in names)
    shares = {k: cases * KINDS[k].weight / total for k in names}
    counts = {k: int(v) for k, v in shares.items()}
    for k in sorted(names, key=lambda k: counts[k] - shares[k])[: max(0, cases - sum(counts.values()))]:
        counts[k] += 1
    return [(k, seed, i) for k in names for i in range(max(1, counts[k]))]


def run_fuzz(cases: list[tuple[str, int, int]], jobs: int = 2, timeout: float = 30.0, batch: int = 64,
             memory_limit_mb: int = 4096, startup_s: float = 60.0,
             progress: Callable[[int, int], None] | None = None) -> Report:
    """Runs the cases in up to `jobs` worker processes of `batch` cases each; `timeout` seconds per case
    (a worker's first case gets `startup_s` more)."""
    report = Report()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ocria-fuzz-") as tmp:
        root = Path(tmp)
        prepare_bases(root / "bases")
        (root / "work").mkdir()
        pending: collections.deque = collections.deque()
        by_kind = collections.defaultdict(list)
        for c in cases:
            by_kind[c[0]].append(c)
        for kind_cases in by_kind.values():
            for i in range(0, len(kind_cases), batch):
                pending.append(kind_cases[i:i + batch])
        # A case may wait on a fork and the worker's own timeout: the runner's deadline is later, and
        # the first case of a worker also waits on its start-up (imports, a model for parse).
        per_case = timeout * 1.5 + 2
        sel = selectors.DefaultSelector()
        running: list[_Worker] = []
        spawned = 0

        def start(batch_cases: list) -> None:
            nonlocal spawned
            spawned += 1
            err = root / f"worker-{spawned}.stderr"
            with open(err, "wb") as ef:
                # one thread per worker: the jobs share the cores, and no thread pool lives across the forks
                env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                       "TOKENIZERS_PARALLELISM": "false"}
                proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                         "--memory-limit-mb", str(memory_limit_mb)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=ef, env=env)
            proc.stdin.write(json.dumps({"bases": str(root / "bases"), "work": str(root / "work"), "timeout": timeout,
                                         "cases": batch_cases}).encode())
            proc.stdin.close()
            w = _Worker(proc, batch_cases, err, deadline=time.monotonic() + startup_s + per_case)
            os.set_blocking(proc.stdout.fileno(), False)
            sel.register(proc.stdout, selectors.EVENT_READ, w)
            running.append(w)

        def finish(w: _Worker, outcome: str, detail: str) -> None:
            """The worker died or hung: its current case gets `outcome`, the rest of its batch goes on."""
            sel.unregister(w.proc.stdout)
            running.remove(w)
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()
            if w.done < len(w.cases):
                kind, seed, index = w.cases[w.done]
                tail = w.stderr_path.read_text(errors="replace").strip().splitlines()[-3:]
                report.results.append({"kind": kind, "seed": seed, "index": index, "outcome": outcome,
                                       "detail": detail + (" | " + " / ".join(tail) if tail else ""),
                                       "what": describe_case(kind, seed, index, root / "bases", root / "work")})
                if progress:
                    progress(len(report.results), len(cases))
                if w.done + 1 < len(w.cases):
                    pending.appendleft(w.cases[w.done + 1:])

        while pending or running:
            while pending and len(running) < jobs:
                start(pending.popleft())
            for key, _ in sel.select(timeout=0.2):
                w = key.data
                chunk = w.proc.stdout.read()
                if chunk is None:
                    continue
                if chunk == b"":
                    code = w.proc.wait()
                    if w.done < len(w.cases):
                        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                        finish(w, "crash", f"the worker {how} during this case")
                    else:
                        sel.unregister(w.proc.stdout)
                        running.remove(w)
                    continue
                w.buffer += chunk
                *lines, w.buffer = w.buffer.split(b"\n")
                for line in lines:
                    report.results.append(json.loads(line))
                    w.done += 1
                    w.deadline = time.monotonic() + per_case
                    if progress:
                        progress(len(report.results), len(cases))
            now = time.monotonic()
            for w in list(running):
                if now > w.deadline:
                    finish(w, "hang", f"no result after {per_case:.0f} s")
    report.wall_s = time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000, help="number of cases, shared among the kinds by weight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kind", action="append", choices=list(KINDS), help="only these kinds (repeatable)")
    ap.add_argument("--case", type=int, help="run this one case of --kind here, verbosely")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds one case may take before it is a hang")
    ap.add_argument("--batch", type=int, default=64, help="cases per worker process")
    ap.add_argument("--memory-limit-mb", type=int, default=4096, help="address-space limit of a worker (0: none)")
    ap.add_argument("--json", type=Path, help="write every case's record here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.memory_limit_mb)
        return 0
    if args.case is not None:
        if not args.kind or len(args.kind) != 1:
            ap.error("--case needs exactly one --kind")
        with tempfile.TemporaryDirectory(prefix="ocria-fuzz-") as tmp:
            prepare_bases(Path(tmp) / "bases")
            (Path(tmp) / "work").mkdir()
            rec = run_case(args.kind[0], args.seed, args.case, Path(tmp) / "bases", Path(tmp) / "work", verbose=True)
        print(json.dumps(rec, indent=2))
        return 0 if rec["outcome"] in PASSING else 1

    def progress(done: int, total: int) -> None:
        if done % 100 == 0 or done == total:
            print(f"  {done} / {total} cases", file=sys.stderr, flush=True)

    cases = plan(args.cases, args.seed, args.kind)
    report = run_fuzz(cases, jobs=args.jobs, timeout=args.timeout, batch=args.batch,
                      memory_limit_mb=args.memory_limit_mb, progress=progress)
    print(f"seed {args.seed}, {len(cases)} cases, {args.jobs} jobs")
    print(report.summary())
    if args.json:
        args.json.write_text(json.dumps(report.results, indent=1))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
