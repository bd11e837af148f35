"""The synthetic document generator (ocria_rt.synthdoc): determinism, Markdown that round-trips, splits,
speed per layout, text sources and font families, and the scoring functions. Needs numpy, Pillow and
faker (dependencies of ocria-rt). test_page_hashes.py pins the pages of fixed seeds."""

from __future__ import annotations

import html
import json
import random
import re
import time
from html.parser import HTMLParser

import numpy as np
import pytest

from ocria_rt import synthdoc
from ocria_rt.synthdoc import LAYOUTS, PageConfig, generate_page, iter_dataset, page_seed


def _pixels(img) -> bytes:
    return np.asarray(img).tobytes()


class _Tables(HTMLParser):
    """Rows and cells of every <table>, with the stdlib's html.parser (independent of synthdoc.metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self.depth = 0

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
            self.depth += 1
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][-1].append(tag)

    def handle_endtag(self, tag):
        if tag == "table":
            self.depth -= 1


def _parse(md: str) -> list[list[list[str]]]:
    p = _Tables()
    p.feed(md)
    p.close()
    assert p.depth == 0, "unclosed <table>"
    return p.tables


def test_same_seed_same_page():
    for seed in (0, 17, page_seed("heldout", 3)):
        for cfg in (None, PageConfig(layout="invoice"), PageConfig(layout="two_column", noise=0.0)):
            a = generate_page(seed, cfg)
            b = generate_page(seed, cfg)
            assert a[1] == b[1]
            assert a[0].size == b[0].size and _pixels(a[0]) == _pixels(b[0])
            assert a[2] == b[2]


def test_different_seeds_differ():
    pages = [generate_page(s) for s in range(6)]
    assert len({md for _, md, _ in pages}) == 6
    assert len({_pixels(img) for img, _, _ in pages}) == 6


def test_markdown_without_render_is_the_same():
    for seed in range(5):
        _, md, meta = generate_page(seed)
        img, md2, meta2 = generate_page(seed, PageConfig(render=False))
        assert img is None and md2 == md
        assert meta2["tables"] == meta["tables"]


def test_tables_parse_as_html_with_the_stated_shape():
    n_tables = 0
    for i in range(12):
        _, md, meta = generate_page(page_seed("train", i, 5), PageConfig(layout="report" if i % 3 else "invoice"))
        tables = _parse(md)
        assert len(tables) == len(meta["tables"]) == md.count("<table>")
        for t, info in zip(tables, meta["tables"]):
            assert len(t) == info["rows"] >= 2
            assert all(len(row) == info["cols"] for row in t)
            assert (t[0][0] == "th") == info["header"]
            assert all(tag == "td" for row in t[1:] for tag in row)
        n_tables += len(tables)
    assert n_tables >= 8


def test_splits_never_overlap():
    train = {page_seed("train", i, s) for s in (0, 1, 7) for i in range(2000)}
    held = {page_seed("heldout", i, s) for s in (0, 1, 7) for i in range(2000)}
    assert len(train) == 6000 and len(held) == 6000 and not train & held
    assert all(synthdoc.split_of(x) == "train" for x in train)
    seeds = [meta["seed"] for _, _, meta in iter_dataset("heldout", 3, seed=0, config=PageConfig(render=False))]
    assert seeds == [page_seed("heldout", i, 0) for i in range(3)] and all(s % 2 == 1 for s in seeds)
    with pytest.raises(ValueError):
        page_seed("test", 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_renders_fast(layout):
    generate_page(0, PageConfig(layout=layout))  # warm the font caches
    for k in range(3):
        t0 = time.perf_counter()
        img, md, meta = generate_page(page_seed("train", k, 11), PageConfig(layout=layout))
        dt = time.perf_counter() - t0
        assert dt < 1.0, f"{layout}: {dt:.2f} s"
        w, h = img.size
        assert img.mode == "RGB" and w % 32 == 0 and h % 32 == 0 and 768 <= max(w, h) <= 1024
        assert meta["layout"] == layout and len(md) > 100
        assert "\n\n\n" not in md and md == md.strip()
        assert md.count("**") % 2 == 0


def test_config_size_budget_and_pillow_font():
    img, md, meta = generate_page(3, PageConfig(size=(512, 640), max_chars=400, fonts="pillow", noise=0.0))
    assert img.size == (512, 640) and len(md) <= 400
    assert meta["font_family"].startswith("Pillow")
    assert all(32 <= ord(ch) < 127 or ch == "\n" for ch in md), "Pillow's font draws ASCII only"
    with pytest.raises(ValueError):
        generate_page(3, PageConfig(size=(500, 640)))


def test_small_pages_with_small_budgets_still_carry_text():
    """Small pages, large type and a budget of a few words (the reading curriculum's regime): every
    layout's blocks may be too tall or too long, and the page then gets a paragraph cut to the budget
    instead of coming out blank (36% of such pages did)."""
    empty, total = 0, 0
    for seed in range(60):
        budget = (20, 40, 120)[seed % 3]
        _, md, _ = generate_page(2 * seed, PageConfig(size=(256, 352), body_px=(40, 56), max_chars=budget, render=False))
        assert len(md) <= budget
        empty += not md.strip()
        total += 1
    assert empty <= total // 20, f"{empty} of {total} pages have no text"


def test_glyph_centres_lie_on_the_drawn_characters():
    """meta["glyphs"] (generate_page(..., glyphs=True)): one centre per visible character drawn, each inside
    the page and with ink around it, on clean pages of every layout; the page itself is unchanged."""
    for i, layout in enumerate(LAYOUTS):
        cfg = PageConfig(layout=layout, size=(384, 512), noise=0.0, max_chars=300)
        img, md, meta = generate_page(100 + i, cfg, glyphs=True)
        plain = generate_page(100 + i, cfg)
        assert _pixels(img) == _pixels(plain[0]) and md == plain[1] and "glyphs" not in plain[2]
        glyphs = meta["glyphs"]
        drawn = "".join(ch for _, _, ch in glyphs)
        # in reading order: the drawn characters are a subsequence of the Markdown (which adds markup) ...
        rest = iter(html.unescape(md))
        assert all(any(c == d for d in rest) for c in drawn), f"{layout}: drawn {drawn!r} not in order in {md!r}"
        # ... and all of its text: what is left after the markup (tags, emphasis, heading/list marks) is drawn
        text = re.sub(r"<[^>]+>|\*\*?|^#+ |^- (\[[ x]\] )?", "", html.unescape(md), flags=re.M)
        assert len(drawn) >= 0.95 * len("".join(text.split())), f"{layout}: {len(drawn)} glyphs for {text!r}"
        gray = np.asarray(img.convert("L"), dtype=np.int32)
        r = max(2, meta["body_px"] // 3)
        inked = 0
        for x, y, ch in glyphs:
            assert 0 <= x < 384 and 0 <= y < 512 and not ch.isspace()
            win = gray[max(0, int(y) - r): int(y) + r + 1, max(0, int(x) - r): int(x) + r + 1]
            inked += int(win.min()) < 160
        assert inked >= 0.97 * len(glyphs), f"{layout}: {len(glyphs) - inked} of {len(glyphs)} centres off the ink"


def test_rotate_points_follows_pillow():
    """The glyph centres follow the scan noise's rotation: a dot rotated by Image.rotate lands where
    rotate_points puts it."""
    from PIL import Image, ImageDraw

    from ocria_rt.synthdoc.pages import rotate_points

    for angle in (1.2, -0.7, 30.0):
        img = Image.new("L", (200, 300), 255)
        ImageDraw.Draw(img).ellipse([147, 57, 153, 63], fill=0)  # centre (150, 60)
        out = np.asarray(img.rotate(angle, resample=Image.Resampling.BILINEAR, fillcolor=255), dtype=np.float64)
        ys, xs = np.nonzero(out < 128)
        (px, py, _), = rotate_points([(150.5, 60.5, "o")], angle, 200, 300)
        assert abs(xs.mean() + 0.5 - px) < 1.0 and abs(ys.mean() + 0.5 - py) < 1.0, (angle, xs.mean(), ys.mean(), px, py)


def test_builtin_words_without_faker():
    _, md, meta = generate_page(4, PageConfig(use_faker=False, layout="article"))
    assert not meta["faker"] and len(md) > 100


def test_asking_for_faker_without_it_is_an_error_not_other_text(monkeypatch):
    from ocria_rt.synthdoc import text

    words = synthdoc.text_source(use_faker=False)
    assert words["generator"] == "synthdoc word lists" and len(words["sha256"]) == 16
    assert synthdoc.text_source()["generator"] == "faker"
    monkeypatch.setattr(text, "_faker_mod", None)
    with pytest.raises(synthdoc.TextSourceMissing, match="faker"):
        generate_page(4, PageConfig(render=False))
    with pytest.raises(synthdoc.TextSourceMissing):
        synthdoc.page_sources()
    _, md, meta = generate_page(4, PageConfig(render=False, use_faker=False))
    assert md and not meta["faker"]


def test_font_families_by_name():
    auto = synthdoc.available_families("auto")
    names = tuple(f.name for f in auto)
    assert synthdoc.available_families(names) == auto
    assert synthdoc.available_families(tuple(reversed(names))) == tuple(reversed(auto)), "the tuple's order"
    records = synthdoc.family_records("auto")
    assert [r["family"] for r in records] == list(names)
    assert records[0]["sha256"] is None  # Pillow's own font
    assert all(len(r["sha256"]) == 16 for r in records[1:])
    # a page of a seed with only Pillow's family listed is the page of fonts="pillow"
    one = generate_page(7, PageConfig(render=False, fonts=(synthdoc.fonts.PILLOW_FAMILY,)))
    assert one[1:] == generate_page(7, PageConfig(render=False, fonts="pillow"))[1:]
    with pytest.raises(ValueError, match="No Such Family"):
        synthdoc.available_families((names[0], "No Such Family"))


def test_a_missing_family_is_drawn_with_one_of_its_kind(monkeypatch):
    from ocria_rt.synthdoc import fonts

    found = fonts.available_families("auto")
    # the machine without one of the families it has: the others keep their slots (and their pages)
    monkeypatch.setattr(fonts, "available_families", lambda which="auto": found[:-1] if which == "auto" else None)
    gone = found[-1].name
    sub = fonts.substitute(gone)
    assert sub.name != gone
    same_kind = [f for f in found[1:-1] if fonts.family_kind(f.name) == fonts.family_kind(gone)]
    assert sub == (same_kind[0] if same_kind else found[0])
    assert fonts.family_kind("STIX General") == "serif" and fonts.family_kind("DejaVu Sans Mono") == "monospace"
    assert fonts.family_kind(fonts.PILLOW_FAMILY) == fonts.family_kind("Roboto") == "sans-serif"


def _model_dir(tmp_path, **record):
    data = {"long_side": [320, 352], "body_px": [40, 56], "chars": [20, 90]}
    (tmp_path / "training.json").write_text(json.dumps({"data": data, **record}))
    return tmp_path


def test_heldout_page_config_follows_the_recorded_sources(tmp_path):
    here = synthdoc.family_records("auto")
    # nothing recorded: the training distribution, faker, every family found
    cfg, rep = synthdoc.heldout_page_config(_model_dir(tmp_path))
    assert cfg.long_side == (320, 352) and cfg.fonts == "auto" and cfg.use_faker
    assert rep["text_trained"] is None and rep["text_matches"] is None and rep["fonts_trained"] is None
    assert rep["fonts_used"] == [f["family"] for f in here]
    # recorded: the same text source; Pillow's font, a family found here with other files, one missing here
    absent = next(n for n in sorted(synthdoc.fonts.KNOWN_FAMILIES) if n not in {f["family"] for f in here})
    fonts = [here[0], {"family": here[-1]["family"], "sha256": "0" * 16}, {"family": absent, "sha256": "1" * 16}]
    cfg, rep = synthdoc.heldout_page_config(_model_dir(tmp_path, text_source=synthdoc.text_source(), fonts=fonts))
    assert rep["text_matches"] is True
    assert cfg.fonts == (here[0]["family"], here[-1]["family"], absent)
    sub = synthdoc.fonts.substitute(absent).name
    assert rep["fonts_used"] == [here[0]["family"], here[-1]["family"], sub] and rep["fonts_missing"] == {absent: sub}
    assert rep["fonts_other_files"] == ([here[-1]["family"]] if len(here) > 1 else [])
    # another faker version, the word lists
    other = {"generator": "faker", "version": "0.0.1"}
    assert synthdoc.heldout_page_config(_model_dir(tmp_path, text_source=other))[1]["text_matches"] is False
    cfg, rep = synthdoc.heldout_page_config(_model_dir(tmp_path, text_source=synthdoc.text_source(use_faker=False)))
    assert not cfg.use_faker and rep["text_matches"] is True


@pytest.mark.parametrize("record, field", [
    ({"text_source": "faker"}, "text_source"),
    ({"text_source": {"generator": "lorem"}}, "unknown generator"),
    ({"fonts": []}, "fonts"),
    ({"fonts": [{"family": "DejaVu Sans", "sha256": 3}]}, "fonts"),
    ({"fonts": [{"family": "No Such Family", "sha256": None}]}, "No Such Family"),
])
def test_heldout_page_config_names_a_malformed_record(tmp_path, record, field):
    with pytest.raises(ValueError, match=field) as e:
        synthdoc.heldout_page_config(_model_dir(tmp_path, **record))
    assert "training.json" in str(e.value)


def test_faker_locales():
    metas = [generate_page(page_seed("train", i, 2), PageConfig(render=False))[2] for i in range(40)]
    assert all(m["faker"] for m in metas)
    assert len({m["locale"] for m in metas}) >= 4
    _, a, _ = generate_page(9, PageConfig(render=False, locales=("de_DE",), layout="letter"))
    _, b, _ = generate_page(9, PageConfig(render=False, locales=("de_DE",), layout="letter", use_faker=False))
    assert a != b


def _dp_levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def test_levenshtein_matches_dynamic_programming():
    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("abc d\n") for _ in range(rng.randint(0, 80)))
        b = "".join(rng.choice("abcd e") for _ in range(rng.randint(0, 80)))
        assert synthdoc.levenshtein(a, b) == _dp_levenshtein(a, b)
    assert synthdoc.levenshtein("kitten", "sitting") == 3
    long_a = "".join(rng.choice("abcdefgh ") for _ in range(300))
    long_b = long_a[:100] + "xyz" + long_a[140:]
    assert synthdoc.levenshtein(long_a, long_b) == _dp_levenshtein(long_a, long_b)


def test_scores():
    _, ref, meta = generate_page(21, PageConfig(layout="report", render=False))
    s = synthdoc.score_page(ref, ref)
    assert s["cer"] == 0.0 and s["tables"] == len(meta["tables"]) == s["tables_exact"]
    assert synthdoc.cer("abcd", "abce") == 0.25 and synthdoc.cer("x \n", "x") == 0.0
    bad = ref.replace("</tr>", "</tr><tr><td>x</td></tr>", 1)
    if meta["tables"]:
        assert synthdoc.score_page(bad, ref)["tables_exact"] == len(meta["tables"]) - 1
    summary = synthdoc.summarize([s, synthdoc.score_page("", ref)])
    assert summary["pages"] == 2 and summary["cer"] == 0.5
    lo, hi = summary["cer_ci95"]  # resampling two pages of CER 0 and 1 gives means 0, 0.5 and 1
    assert lo == 0.0 and hi == 1.0
    from ocria_rt.synthdoc.metrics import mean_interval

    assert mean_interval([0.25] * 50) == (0.25, 0.25)
    lo, hi = mean_interval(np.random.default_rng(1).uniform(0, 1, 400))  # the mean of U(0, 1): 0.5 +- 0.028
    assert 0.44 < lo < 0.5 < hi < 0.56 and 0.045 < hi - lo < 0.07
    structs = synthdoc.table_structures("<table><tr><th>a</th><th colspan='2'>b</th></tr><tr><td>1</td></tr>")
    assert synthdoc.table_shape(structs[0]) == (2, 3)  # an unclosed table still counts


def test_evaluate_with_a_function():
    refs = {}

    def oracle(image, prompt):
        # the "model" looks the page up by its pixels and answers perfectly
        return refs[_pixels(image)]

    for image, md, _ in iter_dataset("heldout", 3, seed=0):
        refs[_pixels(image)] = md
    out = synthdoc.evaluate(oracle, n_pages=3, seed=0, prompt="Convert this page to Markdown.")
    assert out["pages"] == 3 and out["cer"] == 0.0 and out["tables_exact"] == out["tables"]
    layouts = [p["layout"] for p in out["per_page"]]
    assert {k: v["pages"] for k, v in out["by_layout"].items()} == {k: layouts.count(k) for k in set(layouts)}

    def blind(image, prompt):  # right on the first page only
        return refs[_pixels(image)] if _pixels(image) == first else ""

    first = _pixels(next(iter_dataset("heldout", 1, seed=0))[0])
    out = synthdoc.evaluate(blind, n_pages=3, seed=0)
    assert [p["cer"] for p in out["per_page"]] == [0.0, 1.0, 1.0]
    for name, v in out["by_layout"].items():  # each layout's mean over its own pages
        pages = [p for p in out["per_page"] if p["layout"] == name]
        assert v["cer"] == sum(p["cer"] for p in pages) / len(pages)


def test_a_table_cut_down_to_one_row_is_not_placed():
    """Where the room left (here: the page's character budget) holds only one row of a table, the
    table is not placed: every table on a page has at least two rows (what fits depends on the fonts
    a machine has, so generated pages can hit this on one machine and not another)."""
    from ocria_rt.synthdoc.fonts import available_families
    from ocria_rt.synthdoc.layout import Table, Typo

    typo = Typo(available_families()[0], 14, leading=1.3, ink=(0, 0, 0), accent=(0, 0, 0), light=(230, 230, 230))
    table = Table(None, [["a", "b"], ["c", "d"], ["e", "f"]], [False, False])
    row = len("<tr><td>a</td><td>b</td></tr>")
    base = len("<table></table>")
    assert table.layout(typo, 400, max_chars=base + row + 5) is None
    two = table.layout(typo, 400, max_chars=base + 2 * row + 5)
    assert two is not None and two.info["rows"] == 2 and not two.complete
    assert Table(None, [["a", "b"]] * 3, [False, False]).layout(typo, 400).info["rows"] == 3
