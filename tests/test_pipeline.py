"""The page-to-Markdown pipeline (ocria_rt.parse) and `ocria-rt parse`, end to end with the tiny VLM.

Inputs are made in the tests: multi-page PDFs and TIFFs with Pillow, broken files by hand
(tests/pdf_craft.py: a zero-page PDF, a password-protected PDF, a PDF with a broken page object, a PNG
header declaring 1.6 G pixels). max_new_tokens is small and pages are rendered small to keep CI fast.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ocria_rt
import pdf_craft
import vision_cases as vc
from ocria_rt.pipeline import DEFAULT_PROMPT, parse, parse_page_spec, select_pages
from support import TINY_VLM

FAST = dict(max_new_tokens=8, target_long_side=400, progress=False)


def page_images(n: int, width: int = 200, height: int = 260, seed: int = 0):
    from PIL import Image

    return [Image.fromarray(vc.synth_rgb(height, width, seed + i)) for i in range(n)]


def save_multipage(path: Path, images, **kw) -> Path:
    images[0].save(path, save_all=True, append_images=images[1:], **kw)
    return path


@pytest.fixture(scope="module")
def vlm():
    return ocria_rt.Engine(TINY_VLM)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    f = {
        "pdf3": save_multipage(d / "three.pdf", page_images(3)),  # 200 x 260 pt pages (72 dpi)
        "pdf1": save_multipage(d / "one.pdf", page_images(1, seed=7)),
        "png": d / "good.png",
        "corrupt_png": d / "corrupt.png",
        "tiff": d / "pages.tif",
        "zero_pdf": d / "zero.pdf",
        "encrypted_pdf": d / "locked.pdf",
        "broken_page_pdf": d / "broken_page.pdf",
        "garbage_pdf": d / "garbage.pdf",
        "text": d / "notes.txt",
        "empty": d / "empty.png",
        "huge_png": d / "huge.png",
    }
    page_images(1, 120, 90, seed=3)[0].save(f["png"])
    raw = f["png"].read_bytes()
    f["corrupt_png"].write_bytes(raw[: len(raw) // 2])  # a valid header, truncated pixel data
    # a 3-page TIFF whose second page has corrupt compressed data
    rng = np.random.default_rng(0)
    from PIL import Image

    frames = [Image.fromarray(rng.integers(0, 256, (64, 48, 3), dtype=np.uint8)) for _ in range(3)]
    save_multipage(f["tiff"], frames, compression="tiff_deflate")
    with Image.open(f["tiff"]) as im:
        im.seek(1)
        offset, count = im.tag_v2[273][0], im.tag_v2[279][0]
    data = bytearray(f["tiff"].read_bytes())
    data[offset : offset + count] = b"\xff" * count
    f["tiff"].write_bytes(bytes(data))
    pdf_craft.write_zero_page_pdf(f["zero_pdf"])
    pdf_craft.write_encrypted_pdf(f["encrypted_pdf"], user_password=b"secret")
    pdf_craft.write_pdf(f["broken_page_pdf"], [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R 9 0 R 3 0 R] /Count 3 >>",  # object 9 does not exist
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 260] >>",
    ])
    f["garbage_pdf"].write_bytes(b"%PDF-1.4\nthis is not really a PDF\n")
    f["text"].write_text("just some notes\n")
    f["empty"].write_bytes(b"")
    pdf_craft.write_huge_png_header(f["huge_png"], 40000, 40000)
    return f


def markers(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("<!--")]


# --------------------------------------------------------------------------- #
# Python API
# --------------------------------------------------------------------------- #
def test_parse_pdf_one_section_per_page(vlm, files):
    doc = parse(files["pdf3"], engine=vlm, **FAST)
    assert isinstance(doc, ocria_rt.Document) and doc.ok
    assert [p.page_index for p in doc.pages] == [0, 1, 2]
    assert markers(doc.markdown) == ["<!-- page 1 -->", "<!-- page 2 -->", "<!-- page 3 -->"]
    sections = doc.markdown.split("<!-- page ")[1:]
    for p, section in zip(doc.pages, sections):
        assert isinstance(p, ocria_rt.PageResult) and p.error is None and p.markdown is not None
        assert p.markdown in section
        assert p.source == str(files["pdf3"])
        assert max(p.image_size) == 400  # the longer side is target_long_side
        assert p.preprocess_ms > 0 and p.prefill_ms > 0 and p.decode_ms >= 0
        assert 1 <= p.new_tokens <= 8 and p.tokens_per_s >= 0 and p.finish_reason in ("stop", "length")
        assert p.prompt_tokens > p.image_tokens > 0
    assert doc.new_tokens == sum(p.new_tokens for p in doc.pages)
    assert doc.prompt_tokens == sum(p.prompt_tokens for p in doc.pages)
    for key in ("wall_s", "model_load_s", "preprocess_ms", "prefill_ms", "decode_ms", "pages_per_s", "tokens_per_s"):
        assert key in doc.timings and doc.timings[key] >= 0
    assert doc.timings["pages_per_s"] > 0
    json.dumps(doc.to_dict())  # JSON-ready


def test_page_text_is_what_chat_gives_for_the_rendered_page(vlm, files):
    """The pipeline is chat + rendering: the same page image through Engine.chat gives the same text."""
    import pypdfium2 as pdfium

    doc = parse(files["pdf1"], engine=vlm, **FAST)
    pdf = pdfium.PdfDocument(str(files["pdf1"]))
    page = pdf[0]
    image = page.render(scale=400 / max(page.get_size())).to_pil()
    page.close()
    pdf.close()
    r = vlm.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                               {"type": "text", "text": DEFAULT_PROMPT}]}], max_new_tokens=8)
    assert doc.pages[0].markdown == r.text.strip()
    assert doc.pages[0].prompt_tokens == r.prompt_tokens


def test_pages_selection_and_dpi(vlm, files):
    doc = parse(files["pdf3"], engine=vlm, pages="1,3", **FAST)
    assert [p.page_number for p in doc.pages] == [1, 3]
    assert markers(doc.markdown) == ["<!-- page 1 -->", "<!-- page 3 -->"]
    doc = parse(files["pdf3"], engine=vlm, pages="2-", dpi=36, max_new_tokens=4, progress=False)
    assert [p.page_number for p in doc.pages] == [2, 3]
    assert doc.pages[0].image_size == (100, 130)  # 200 x 260 pt at 36 dpi


def test_page_spec_parsing():
    assert parse_page_spec("1-3,7") == [(1, 3), (7, 7)]
    assert parse_page_spec(" 5- , 2") == [(5, None), (2, 2)]
    assert parse_page_spec([2, 4]) == [(2, 2), (4, 4)]
    assert select_pages(parse_page_spec("1-3,7,2"), 5) == [0, 1, 2]
    assert select_pages(parse_page_spec("4-"), 6) == [3, 4, 5]
    assert select_pages(None, 2) == [0, 1]
    for bad in ("0", "3-1", "a", "", "1,,2", "-", "1-2-3", "0-2"):
        with pytest.raises(ocria_rt.InvalidArgumentError, match="page"):
            parse_page_spec(bad)


def test_failed_pages_are_recorded_and_others_go_on(vlm, files):
    inputs = [files["pdf1"], files["corrupt_png"], files["png"], files["tiff"], files["broken_page_pdf"]]
    doc = parse(inputs, engine=vlm, **FAST)
    got = [(Path(p.source).name, p.page_number, p.error is None) for p in doc.pages]
    assert got == [
        ("one.pdf", 1, True),
        ("corrupt.png", 1, False),
        ("good.png", 1, True),
        ("pages.tif", 1, True), ("pages.tif", 2, False), ("pages.tif", 3, True),
        ("broken_page.pdf", 1, True), ("broken_page.pdf", 2, False), ("broken_page.pdf", 3, True),
    ]
    assert not doc.ok and len(doc.failed_pages) == 3
    by_name = {(Path(p.source).name, p.page_number): p for p in doc.pages}
    assert "truncated or corrupt" in by_name[("corrupt.png", 1)].error
    assert str(files["corrupt_png"]) in by_name[("corrupt.png", 1)].error
    assert "page 2 of" in by_name[("pages.tif", 2)].error
    assert "page 2 of" in by_name[("broken_page.pdf", 2)].error
    for p in doc.failed_pages:
        assert p.markdown is None and p.new_tokens == 0
    # several inputs: markers name the source; failed pages leave an error comment
    m = markers(doc.markdown)
    assert m[0] == f"<!-- {files['pdf1']}: page 1 -->"
    assert len([x for x in m if ": page " in x]) == 9
    assert sum("<!-- error:" in x for x in m) == 3


def test_image_over_the_pixel_limit(vlm, files):
    doc = parse(files["huge_png"], engine=vlm, **FAST)  # 40000 x 40000 declared: Pillow's bomb guard
    assert [p.error is not None for p in doc.pages] == [True]
    assert "too large" in doc.pages[0].error and str(files["huge_png"]) in doc.pages[0].error
    doc = parse(files["png"], engine=vlm, max_image_pixels=1000, **FAST)
    assert "max_image_pixels" in doc.pages[0].error
    doc = parse(files["pdf1"], engine=vlm, dpi=2000, max_image_pixels=10**6, max_new_tokens=4, progress=False)
    assert "lower dpi" in doc.pages[0].error


@pytest.mark.parametrize("key,match", [
    ("missing", "does not exist"),
    ("dir", "is a directory"),
    ("text", "neither a PDF nor an image"),
    ("empty", "is empty"),
    ("zero_pdf", "has no pages"),
    ("encrypted_pdf", "password-protected"),
    ("garbage_pdf", "cannot open PDF"),
])
def test_whole_input_errors_name_the_file(vlm, files, key, match):
    path = {"missing": files["pdf1"].parent / "missing.pdf", "dir": files["pdf1"].parent}.get(key) or files[key]
    with pytest.raises(ocria_rt.FileError, match=match) as e:
        parse(path, engine=vlm, **FAST)
    assert str(path) in str(e.value)


def test_selection_matching_nothing(vlm, files):
    with pytest.raises(ocria_rt.InvalidArgumentError, match="matches no page"):
        parse(files["pdf3"], engine=vlm, pages="9", **FAST)


def test_several_inputs_record_whole_input_errors(vlm, files):
    missing = files["pdf1"].parent / "missing.pdf"
    doc = parse([missing, files["pdf1"], files["encrypted_pdf"]], engine=vlm, **FAST)
    assert [Path(e.source).name for e in doc.input_errors] == ["missing.pdf", "locked.pdf"]
    assert "password-protected" in doc.input_errors[1].error
    assert len(doc.pages) == 1 and doc.pages[0].ok and not doc.ok
    assert markers(doc.markdown)[0].startswith(f"<!-- {missing}: error:")
    with pytest.raises(ocria_rt.FileError, match="no input could be read"):
        parse([missing, files["zero_pdf"]], engine=vlm, **FAST)


def test_progress_line(vlm, files):
    out = io.StringIO()
    parse(files["pdf3"], engine=vlm, pages="1-2", max_new_tokens=4, target_long_side=400, progress="always",
          progress_stream=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("ocria-rt: 2/2 pages")
    assert all("pages/s" in x and "tokens/s" in x for x in lines)
    out = io.StringIO()  # not a terminal: quiet unless forced
    parse(files["pdf1"], engine=vlm, max_new_tokens=4, target_long_side=400, progress=True, progress_stream=out)
    assert out.getvalue() == ""
    with pytest.raises(ocria_rt.InvalidArgumentError, match="progress"):
        parse(files["pdf1"], engine=vlm, progress="sometimes")


def test_custom_prompt_and_model_directory(files):
    a = parse(files["png"], engine=TINY_VLM, prompt="Read.", max_new_tokens=4, progress=False)
    b = parse(files["png"], max_new_tokens=4, progress=False)  # the default VLM
    assert a.pages[0].ok and b.pages[0].ok
    assert a.pages[0].prompt_tokens < b.pages[0].prompt_tokens
    assert a.model == str(TINY_VLM) or Path(a.model).resolve() == TINY_VLM.resolve()


def test_text_only_model_is_refused(files):
    from support import FIXTURES

    with pytest.raises(ocria_rt.InvalidArgumentError, match="no vision encoder"):
        parse(files["png"], engine=ocria_rt.Engine(FIXTURES / "text_tied"), **FAST)


def test_bad_arguments(vlm, files):
    for kw in (dict(dpi=0), dict(target_long_side=0), dict(max_new_tokens=0)):
        with pytest.raises(ocria_rt.InvalidArgumentError):
            parse(files["pdf1"], engine=vlm, **{**FAST, **kw})
    with pytest.raises(ocria_rt.InvalidArgumentError, match="at least one"):
        parse([], engine=vlm)


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #
def cli(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ocria_rt.cli", "parse", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_cli_parse_writes_markdown_and_json(files, tmp_path):
    md, js = tmp_path / "out.md", tmp_path / "out.json"
    r = cli(files["pdf3"], "-o", md, "--json", js, "--pages", "1-2", "--max-new-tokens", "8",
            "--target-long-side", "400", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert markers(md.read_text()) == ["<!-- page 1 -->", "<!-- page 2 -->"]
    data = json.loads(js.read_text())
    assert [p["page_number"] for p in data["pages"]] == [1, 2]
    for p in data["pages"]:
        assert p["error"] is None and isinstance(p["markdown"], str)
        for key in ("preprocess_ms", "prefill_ms", "decode_ms", "new_tokens", "tokens_per_s", "prompt_tokens"):
            assert key in p
    assert data["markdown"] == md.read_text() and data["num_failed_pages"] == 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.json", "out.md"]  # no temporary files left


def test_cli_parse_some_pages_failed(files, tmp_path):
    md, js = tmp_path / "out.md", tmp_path / "out.json"
    r = cli(files["pdf1"], files["corrupt_png"], "-o", md, "--json", js, "--max-new-tokens", "4",
            "--target-long-side", "400", "--progress")
    assert r.returncode == 1, r.stderr
    data = json.loads(js.read_text())
    assert [p["error"] is None for p in data["pages"]] == [True, False]
    assert "truncated or corrupt" in data["pages"][1]["error"]
    assert "corrupt.png" in r.stderr and "failed" in r.stderr
    assert "pages/s" in r.stderr  # --progress forces the progress line on a pipe
    assert "<!-- error:" in md.read_text()


def test_cli_parse_markdown_to_stdout(files):
    r = cli(files["png"], "--max-new-tokens", "4", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("<!-- page 1 -->")


@pytest.mark.parametrize("key,args,match", [
    ("missing", [], "does not exist"),
    ("text", [], "neither a PDF nor an image"),
    ("zero_pdf", [], "has no pages"),
    ("encrypted_pdf", [], "password-protected"),
    ("pdf1", ["--pages", "0"], "bad page"),
    ("pdf1", ["--max-new-tokens", "0"], "max_new_tokens"),
    ("pdf1", ["--json", "/nonexistent/dir/out.json"], "output directory"),
])
def test_cli_parse_input_errors_write_nothing(files, tmp_path, key, args, match):
    md = tmp_path / "out.md"
    md.write_text("previous contents\n")
    path = tmp_path / "missing.pdf" if key == "missing" else files[key]
    r = cli(path, "-o", md, *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert match in r.stderr and "Traceback" not in r.stderr
    assert md.read_text() == "previous contents\n"  # untouched
    assert [x.name for x in tmp_path.iterdir()] == ["out.md"]


def test_cli_parse_usage_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ocria_rt.cli", "parse"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "INPUT" in r.stderr
    r = cli("--sample", tmp_path / "a.pdf")
    assert r.returncode == 2 and "not both" in r.stderr


def test_cli_parse_sample_prints_markdown_and_its_score():
    r = cli("--sample", "--no-progress")
    assert r.returncode == 0, r.stderr
    n = len(json.loads(ocria_rt.sample_document().with_suffix(".json").read_text())["markdown"])
    assert [f"<!-- page {i} -->" in r.stdout for i in range(1, n + 1)] == [True] * n, r.stdout
    assert "character error rate against the true Markdown" in r.stderr, r.stderr


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    from ocria_rt import cli as cli_mod

    target = tmp_path / "x.md"
    target.write_text("old")

    def boom(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        cli_mod._write_atomic(str(target), "new")
    assert target.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["x.md"]
