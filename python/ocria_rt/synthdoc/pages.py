"""Page composition: a layout type fills a page with blocks, in reading order, then it is drawn.

Layout types (:data:`LAYOUTS`):
- ``article``: title, byline, paragraphs, headings, lists, the odd table or key-value block;
- ``two_column``: a full-width title (and abstract), then two columns read left then right;
- ``report``: headings, paragraphs and several tables with captions;
- ``invoice``: seller and invoice details side by side, bill-to address, an item table whose amounts
  add up, totals, payment terms;
- ``form``: sections of key-value fields (some blank, drawn as lines) and checkboxes;
- ``letter``: sender, date, recipient, subject, salutation, paragraphs, closing.
Any of them may carry a running header and a footer / page number (``PageConfig.furniture``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from .fonts import FontFamily, available_families
from .layout import (TABLE_STYLES, Block, Heading, KeyValue, Laid, Lines, ListBlock, ListItem, Paragraph, Table,
                     Typo, draw_ops, shift_ops, text_glyphs)
from .noise import scan_noise
from .text import TextSource, faker_available, pick_locale

LAYOUTS: tuple[str, ...] = ("article", "two_column", "report", "invoice", "form", "letter")
LAYOUT_WEIGHTS: dict[str, float] = {"article": 0.24, "two_column": 0.16, "report": 0.2, "invoice": 0.14,
                                    "form": 0.12, "letter": 0.14}


@dataclass(frozen=True)
class PageConfig:
    """What kind of pages to make. Every field has a default; sizes are in pixels."""

    layout: str | None = None  # one of LAYOUTS; None: drawn from `layouts` with LAYOUT_WEIGHTS
    layouts: tuple[str, ...] | None = None  # restricts the random choice of layout
    size: tuple[int, int] | None = None  # (width, height); None: drawn from long_side / aspect
    long_side: tuple[int, int] = (768, 1024)  # range of the longer side
    aspect: tuple[float, float] = (1.25, 1.45)  # long / short side
    landscape: float = 0.04  # probability that a page is landscape
    multiple_of: int = 32  # both sides are multiples of this (32 = patch 16 x merge 2: no resize later)
    body_px: tuple[int, int] = (13, 19)  # body font size range at a long side of 1024 (scaled with it)
    max_chars: int | None = None  # stop adding content before the Markdown exceeds this
    noise: float = 1.0  # scan-noise strength (0: clean renders)
    # "auto": Pillow's font + system families; "pillow": Pillow's font only; a tuple of family names: one
    # family per name, in order, a name not found here drawn with a found family of its kind (fonts.available_families)
    fonts: str | tuple[str, ...] = "auto"
    use_faker: bool = True  # text from faker (an error where it is not installed); False: the built-in word lists
    locales: tuple[str, ...] | None = None  # restrict the locales (e.g. ("en_US",))
    furniture: float = 0.55  # probability of a running header / footer / page number
    render: bool = True  # False: no pixels (Markdown and meta only, much faster; image is None)


# --------------------------------------------------------------------------- #
# Placement
# --------------------------------------------------------------------------- #
class Page:
    """Blocks placed on a page, in reading order, with the remaining character budget."""

    def __init__(self, w: int, h: int, typo: Typo, max_chars: float) -> None:
        self.w, self.h, self.typo = w, h, typo
        self.placed: list[tuple[float, float, Laid]] = []
        self.chars_left = max_chars

    def place(self, x: float, y: float, laid: Laid) -> None:
        self.placed.append((x, y, laid))
        self.chars_left -= len(laid.md) + 2

    def budget(self) -> float:
        return self.chars_left - 2


class Flow:
    """Blocks stacked top to bottom in one or more columns (read column after column)."""

    def __init__(self, page: Page, cols: list[tuple[float, float]], top: float, bottom: float) -> None:
        self.page, self.cols, self.top, self.bottom = page, cols, top, bottom
        self.ci = 0
        self.y = top
        self.full = False

    @property
    def width(self) -> int:
        return int(self.cols[self.ci][1])

    def add(self, block: Block, gap: float = 0.0, x_align: str = "left") -> bool:
        """Places `block` (cut to fit at the end of the last column); False once the flow is full."""
        if self.full:
            return False
        while True:
            x, width = self.cols[self.ci]
            y = self.y + (gap if self.y > self.top else 0.0)
            avail = self.bottom - y
            laid = block.layout(self.page.typo, int(width), avail, self.page.budget()) if avail > 4 else None
            if laid is not None and laid.complete:
                self._put(x, width, y, laid, x_align)
                return True
            if self.ci + 1 < len(self.cols):
                self.ci += 1
                self.y = self.top
                continue
            if laid is not None and laid.h > 0:
                self._put(x, width, y, laid, x_align)
            self.full = True
            return False

    def _put(self, x: float, width: float, y: float, laid: Laid, x_align: str) -> None:
        if x_align == "right":
            x += width - laid.w
        elif x_align == "center":
            x += (width - laid.w) / 2
        self.page.place(x, y, laid)
        self.y = y + laid.h

    def row(self, parts: list[tuple[Block, float, float]], gap: float = 0.0) -> bool:
        """Blocks side by side at the same height: (block, x offset from the column, width); read left to right."""
        if self.full:
            return False
        x0, _ = self.cols[self.ci]
        y = self.y + (gap if self.y > self.top else 0.0)
        avail = self.bottom - y
        lays = []
        budget = self.page.budget()
        for block, dx, width in parts:
            laid = block.layout(self.page.typo, int(width), avail, budget)
            if laid is None or not laid.complete:
                self.full = True
                return False
            budget -= len(laid.md) + 2
            lays.append((x0 + dx, laid))
        for x, laid in lays:
            self.page.place(x, y, laid)
        self.y = y + max(l.h for _, l in lays)
        return True


# --------------------------------------------------------------------------- #
# Content
# --------------------------------------------------------------------------- #
class Content:
    """Makes the blocks of one page (text, typography choices) from the page's random stream."""

    def __init__(self, rng: random.Random, ts: TextSource, typo: Typo, page_w: int) -> None:
        self.rng, self.ts, self.typo = rng, ts, typo
        self.page_w = page_w
        s = typo.size
        self.h_sizes = {1: round(s * rng.uniform(1.6, 2.2)), 2: round(s * rng.uniform(1.3, 1.6)),
                        3: round(s * rng.uniform(1.08, 1.25))}
        self.h_style = "b" if rng.random() < 0.85 else "r"
        self.h_numbered = rng.random() < 0.3
        self.h_rule = rng.random() < 0.15
        self.h_counter = [0, 0]
        self.align = "justify" if rng.random() < 0.35 else "left"
        self.indent = round(s * rng.uniform(1.0, 2.5)) if rng.random() < 0.15 else 0
        self.para_gap = typo.line_h() * (rng.uniform(0.2, 0.45) if self.indent else rng.uniform(0.45, 1.1))
        self.emphasis = rng.random() < 0.5
        self.list_marker = rng.choice(["disc", "disc", "circle", "square", "dash"])
        self.num_marker = "." if rng.random() < 0.8 else ")"
        self.table_style = rng.choice(TABLE_STYLES)
        self.table_head_fill = rng.random() < 0.3
        self.table_head_align = rng.choice(["left", "left", "center", "same"])
        self.kv_key_style = "b" if rng.random() < 0.7 else "r"
        self.tables = 0
        self.column_rule: tuple[float, float, float] | None = None
        self.header_rule: float | None = None

    # ---- text blocks ----
    def runs(self, text: str) -> list[tuple[str, str]]:
        """A text as runs, with the odd bold / italic phrase when the page uses emphasis."""
        if not self.emphasis or self.rng.random() < 0.5:
            return [(text, "r")]
        ws = text.split(" ")
        if len(ws) < 6:
            return [(text, "r")]
        n = self.rng.randint(1, min(4, len(ws) // 3))
        i = self.rng.randrange(0, len(ws) - n)
        style = "b" if (self.rng.random() < 0.6 or not self.typo.fam.has_italic) else "i"
        phrase = " ".join(ws[i:i + n]).rstrip(".,;:!?")
        trail = " ".join(ws[i:i + n])[len(phrase):]
        runs = []
        if i:
            runs.append((" ".join(ws[:i]), "r"))
        runs.append((phrase, style))
        rest = (trail + " " + " ".join(ws[i + n:])).strip() if i + n < len(ws) else trail
        if rest:
            if trail:  # punctuation right after an emphasised phrase stays outside the markers
                return [(text, "r")]
            runs.append((rest, "r"))
        return runs

    def paragraph(self, lo: int = 2, hi: int = 6, **kw: Any) -> Paragraph:
        return Paragraph(self.runs(self.ts.paragraph(lo, hi)), align=kw.pop("align", self.align),
                         indent=kw.pop("indent", self.indent), **kw)

    def heading(self, level: int, text: str | None = None) -> Heading:
        text = text or self.ts.title(2, 7 if level > 1 else 9)
        if self.h_numbered and level > 1:
            if level == 2:
                self.h_counter = [self.h_counter[0] + 1, 0]
                text = f"{self.h_counter[0]}. {text}" if self.rng.random() < 0.5 else f"{self.h_counter[0]} {text}"
            else:
                self.h_counter[1] += 1
                text = f"{max(1, self.h_counter[0])}.{self.h_counter[1]} {text}"
        align = "center" if (level == 1 and self.rng.random() < 0.35) else "left"
        return Heading(text, level, self.h_sizes[level], align=align, style=self.h_style,
                       rule=self.h_rule and level <= 2)

    def list_block(self, ordered: bool | None = None, checkbox: bool = False) -> ListBlock:
        rng = self.rng
        ordered = (rng.random() < 0.45) if ordered is None else ordered
        items = []
        nested = rng.random() < 0.25 and not checkbox
        for _ in range(rng.randint(2, 7)):
            short = rng.random() < 0.5
            text = self.ts.sentence(2, 6) if short else self.ts.sentence(6, 22)
            if short and rng.random() < 0.5:
                text = text.rstrip(".!?")
            items.append(ListItem(self.runs(text), 0, (rng.random() < 0.5) if checkbox else None))
            if nested and rng.random() < 0.35:
                for _ in range(rng.randint(1, 3)):
                    items.append(ListItem([(self.ts.sentence(2, 8).rstrip("."), "r")], 1))
        if checkbox:
            ordered = False
        return ListBlock(items, ordered=ordered, start=1 if rng.random() < 0.9 else rng.randint(2, 9),
                         marker=self.num_marker if ordered else self.list_marker)

    def caption(self) -> Paragraph:
        self.tables += 1
        label = self.rng.choice(["Table", "Tab.", "Table", "Exhibit"])
        text = f"{label} {self.tables}: {self.ts.title(2, 7)}"
        style = "i" if (self.typo.fam.has_italic and self.rng.random() < 0.5) else ("b" if self.rng.random() < 0.3 else "r")
        return Paragraph([(text, style)], align="left", size=max(6, round(self.typo.size * 0.9)), indent=0)

    # ---- tables ----
    def table(self, width: float, rows: tuple[int, int] = (2, 10)) -> Table:
        rng, ts = self.rng, self.ts
        max_cols = max(2, min(7, int(width / (self.typo.size * 6))))
        ncol = rng.randint(2, max_cols)
        kinds = ["text"] + [rng.choice(["text", "int", "amount", "decimal", "percent", "date", "code", "name",
                                        "city", "year"]) for _ in range(ncol - 1)]
        if rng.random() < 0.25:  # a matrix of numbers by period
            kinds = ["text"] + ["decimal" if rng.random() < 0.5 else "int"] * (ncol - 1)
            periods = rng.choice([[f"Q{i}" for i in range(1, 5)], [str(ts.year - ncol + 2 + i) for i in range(ncol)],
                                  ts.months[:12]])
            start = rng.randrange(0, max(1, len(periods) - (ncol - 1) + 1))
            header = [ts.title(1, 2)] + [ts.clean(p[:3].title() if len(p) > 4 else p) for p in periods[start:start + ncol - 1]]
            if len(header) < ncol:
                header += [f"C{i}" for i in range(len(header), ncol)]
        else:
            header = [self._col_title(k) for k in kinds]
        nrow = rng.randint(*rows)
        body = [[self._cell(k) for k in kinds] for _ in range(nrow)]
        if rng.random() < 0.15:  # a totals row
            body.append([ts.label("total")] + [self._cell(k) if k in ("int", "amount", "decimal") else "" for k in kinds[1:]])
        for r in body:  # the odd empty cell
            if rng.random() < 0.1:
                r[rng.randrange(1, ncol)] = rng.choice(["", "-", "n/a"])
        numeric = [k in ("int", "amount", "decimal", "percent", "year") for k in kinds]
        has_header = rng.random() < 0.93
        return Table(header if has_header else None, body, numeric, style=self.table_style,
                     size=max(6, round(self.typo.size * rng.uniform(0.8, 1.0))),
                     stretch=rng.random() < 0.35, header_align=self.table_head_align, head_fill=self.table_head_fill)

    def _col_title(self, kind: str) -> str:
        ts, rng = self.ts, self.rng
        options = {
            "text": [ts.title(1, 2), ts.label("description"), ts.label("item")],
            "int": [ts.label("qty"), ts.title(1, 1), "No."],
            "amount": [ts.label("amount"), ts.label("unit_price"), ts.title(1, 1), ts.label("total")],
            "decimal": [ts.title(1, 2), ts.title(1, 1)],
            "percent": ["%", ts.title(1, 1), ts.label("discount")],
            "date": [ts.label("date"), ts.label("due")],
            "code": [ts.label("reference"), "ID", ts.label("order_no")],
            "name": [ts.label("name")],
            "city": [ts.label("city")],
            "year": [ts.title(1, 1)],
        }
        return rng.choice(options[kind])

    def _cell(self, kind: str) -> str:
        ts, rng = self.ts, self.rng
        if kind == "text":
            return ts.title(1, 3) if rng.random() < 0.4 else ts.clean(" ".join(ts.words(rng.randint(1, 4))).capitalize())
        if kind == "int":
            return ts.number(int(10 ** rng.uniform(0, rng.choice([2, 3, 5]))))
        if kind == "amount":
            return ts.amount(ts.money_value(), currency=rng.random() < 0.4)
        if kind == "decimal":
            return ts.number(rng.uniform(0, 10 ** rng.randint(1, 4)), rng.choice([1, 2]))
        if kind == "percent":
            return ts.percent()
        if kind == "date":
            return ts.date()
        if kind == "code":
            return ts.code()
        if kind == "name":
            return ts.name()
        if kind == "city":
            return ts.city()
        return str(rng.randint(1990, 2030))

    # ---- key-value ----
    def kv(self, kind: str = "generic", n: tuple[int, int] = (3, 7), blanks: float = 0.0,
           aligned: bool | None = None) -> KeyValue:
        ts, rng = self.ts, self.rng
        fields = {
            "person": [("name", ts.name), ("address", lambda: ", ".join(ts.address_lines())), ("city", ts.city),
                       ("phone", ts.phone), ("email", ts.email), ("birth", ts.date), ("occupation", ts.job),
                       ("company", ts.company)],
            "generic": [("reference", ts.code), ("date", ts.date), ("name", ts.name), ("company", ts.company),
                        ("order_no", lambda: ts.code("PO")), ("customer_no", lambda: ts.code("")),
                        ("amount", lambda: ts.amount(ts.money_value())), ("city", ts.city), ("phone", ts.phone)],
        }[kind]
        field_list: list[tuple[str, Any]] = fields  # type: ignore[assignment]
        k = min(len(field_list), rng.randint(*n))
        chosen = rng.sample(field_list, k)
        pairs = []
        for key, fn in chosen:
            value = "" if rng.random() < blanks else fn()
            pairs.append((ts.label(key), value))
        sep = ":" if rng.random() < 0.9 else ""
        return KeyValue(pairs, key_style=self.kv_key_style, sep=sep,
                        aligned=(rng.random() < 0.6) if aligned is None else aligned)


# --------------------------------------------------------------------------- #
# Layouts
# --------------------------------------------------------------------------- #
def _body_blocks(c: Content, flow: Flow, weights: dict[str, float], max_blocks: int = 60) -> None:
    """Adds blocks drawn by `weights` until the flow is full."""
    rng = c.rng
    kinds, ws = zip(*weights.items())
    last = None
    seen_h2 = False
    for _ in range(max_blocks):
        kind = rng.choices(kinds, weights=ws)[0]
        if kind == "heading" and last == "heading":
            kind = "paragraph"
        lh = c.typo.line_h()
        if kind == "paragraph":
            ok = flow.add(c.paragraph(), c.para_gap)
        elif kind == "heading":
            level = 3 if (seen_h2 and rng.random() < 0.35) else 2
            seen_h2 = seen_h2 or level == 2
            ok = flow.add(c.heading(level), lh * rng.uniform(0.8, 1.4))
        elif kind == "list":
            ok = flow.add(c.list_block(), c.para_gap)
        elif kind == "checklist":
            ok = flow.add(c.list_block(checkbox=True), c.para_gap)
        elif kind == "table":
            gap = lh * rng.uniform(0.6, 1.2)
            caption_first = rng.random() < 0.5
            has_caption = rng.random() < 0.5
            if has_caption and caption_first:
                if not flow.add(c.caption(), gap):
                    break
                gap = lh * 0.3
            ok = flow.add(c.table(flow.width), gap)
            if ok and has_caption and not caption_first:
                ok = flow.add(c.caption(), lh * 0.3)
        elif kind == "kv":
            ok = flow.add(c.kv(rng.choice(["person", "generic"])), c.para_gap)
        else:  # pragma: no cover
            raise ValueError(kind)
        last = kind
        if not ok:
            break


def _title(c: Content, flow: Flow) -> None:
    rng = c.rng
    flow.add(c.heading(1), 0)
    if rng.random() < 0.5:
        parts = [c.ts.name() if rng.random() < 0.6 else c.ts.company(), c.ts.date()]
        text = rng.choice([" - ", ", ", " / "]).join(parts)
        style = "i" if (c.typo.fam.has_italic and rng.random() < 0.5) else "r"
        flow.add(Paragraph([(text, style)], align="left", size=max(6, round(c.typo.size * 0.9))), c.typo.line_h() * 0.4)


def layout_article(c: Content, page: Page, frame: tuple[float, float, float, float]) -> None:
    x, y, w, bottom = frame
    flow = Flow(page, [(x, w)], y, bottom)
    if c.rng.random() < 0.85:
        _title(c, flow)
    _body_blocks(c, flow, {"paragraph": 0.46, "heading": 0.15, "list": 0.17, "table": 0.08, "kv": 0.05,
                           "checklist": 0.02})


def layout_two_column(c: Content, page: Page, frame: tuple[float, float, float, float]) -> None:
    x, y, w, bottom = frame
    rng = c.rng
    top = Flow(page, [(x, w)], y, bottom)
    _title(c, top)
    if rng.random() < 0.5:
        style = "i" if (c.typo.fam.has_italic and rng.random() < 0.5) else "r"
        top.add(Paragraph([(c.ts.paragraph(2, 4), style)], align="justify"), c.para_gap)
    gap = round(w * rng.uniform(0.035, 0.06))
    cw = (w - gap) / 2
    start = top.y + c.typo.line_h() * rng.uniform(0.8, 1.5)
    if rng.random() < 0.3:  # a rule between the columns (decoration: not in the Markdown)
        c.column_rule = (x + cw + gap / 2, start, bottom)
    flow = Flow(page, [(x, cw), (x + cw + gap, cw)], start, bottom)
    _body_blocks(c, flow, {"paragraph": 0.55, "heading": 0.16, "list": 0.17, "table": 0.06, "kv": 0.03,
                           "checklist": 0.03})


def layout_report(c: Content, page: Page, frame: tuple[float, float, float, float]) -> None:
    x, y, w, bottom = frame
    flow = Flow(page, [(x, w)], y, bottom)
    if c.rng.random() < 0.8:
        _title(c, flow)
    _body_blocks(c, flow, {"paragraph": 0.34, "heading": 0.16, "list": 0.07, "table": 0.35, "kv": 0.08})


def layout_invoice(c: Content, page: Page, frame: tuple[float, float, float, float]) -> None:
    x, y, w, bottom = frame
    rng, ts, typo = c.rng, c.ts, c.typo
    flow = Flow(page, [(x, w)], y, bottom)
    lh = typo.line_h()
    seller_lines: list[tuple[str, str]] = [(ts.company(), "b")] + [(a, "r") for a in ts.address_lines()]
    if rng.random() < 0.6:
        seller_lines.append((f"{ts.label('phone')}: {ts.phone()}", "r"))
    if rng.random() < 0.4:
        seller_lines.append((ts.email(), "r"))
    seller = Lines(seller_lines, size=max(6, round(typo.size * 0.95)))
    meta_pairs = [(ts.label("invoice_no"), ts.code("INV" if rng.random() < 0.5 else "")),
                  (ts.label("date"), ts.date())]
    if rng.random() < 0.7:
        meta_pairs.append((ts.label("due"), ts.date()))
    if rng.random() < 0.5:
        meta_pairs.append((ts.label("customer_no"), ts.code("")))
    if rng.random() < 0.3:
        meta_pairs.append((ts.label("order_no"), ts.code("PO")))
    meta = KeyValue(meta_pairs, key_style=c.kv_key_style, aligned=True)
    title = Heading(ts.label("invoice").upper() if rng.random() < 0.5 else ts.label("invoice"), 1, c.h_sizes[1],
                    style=c.h_style)
    half = w * 0.48
    if rng.random() < 0.5:  # seller left, title + details right
        ok = flow.row([(seller, 0, half), (title, w * 0.55, w * 0.45)], 0)
        ok = ok and flow.row([(meta, w * 0.55, w * 0.45)], lh * 0.4)
    else:  # title on top, seller left, details right
        ok = flow.add(title, 0) and flow.row([(seller, 0, half), (meta, w * 0.55, w * 0.45)], lh)
    if not ok:
        return
    bill = [(ts.label("bill_to") + ":", "b"), (ts.name(), "r")]
    if rng.random() < 0.5:
        bill.append((ts.company(), "r"))
    bill += [(a, "r") for a in ts.address_lines()]
    if not flow.add(Lines(bill), lh * rng.uniform(1.0, 2.0)):
        return
    if rng.random() < 0.3 and not flow.add(c.paragraph(1, 2, align="left", indent=0), lh):
        return
    # the item table: amounts that add up
    n = rng.randint(1, 12)
    cols = ["description", "qty", "unit_price", "amount"]
    with_pos = rng.random() < 0.4
    rows, subtotal = [], 0.0
    for i in range(n):
        qty = rng.choice([1, 1, 1, 2, 3, 4, 5, 10, 12, 20, 25, 50, 100])
        unit = ts.money_value(0.5, 2000.0 if qty < 10 else 80.0)
        amt = round(qty * unit, 2)
        subtotal += amt
        row = [ts.product(), ts.number(qty), ts.amount(unit, currency=False), ts.amount(amt, currency=False)]
        rows.append(([str(i + 1)] if with_pos else []) + row)
    header = ([ts.label("item")] if with_pos else []) + [ts.label(k) for k in cols]
    numeric = ([True] if with_pos else []) + [False, True, True, True]
    table = Table(header, rows, numeric, style=c.table_style, size=max(6, round(typo.size * rng.uniform(0.85, 1.0))),
                  stretch=rng.random() < 0.8, header_align=c.table_head_align, head_fill=c.table_head_fill)
    if not flow.add(table, lh * rng.uniform(1.0, 1.8)):
        return
    rate = rng.choice([5, 7, 10, 19, 20, 21, 22, 25])
    tax = round(subtotal * rate / 100, 2)
    totals = [(ts.label("subtotal"), ts.amount(subtotal)), (f"{ts.label('tax')} {rate}%", ts.amount(tax)),
              (ts.label("total"), ts.amount(subtotal + tax))]
    if not flow.row([(KeyValue(totals, key_style="b" if rng.random() < 0.6 else "r", aligned=True), w * 0.5, w * 0.5)],
                    lh * 0.8):
        return
    if rng.random() < 0.7:
        days = rng.choice([7, 10, 14, 30, 45, 60])
        flow.add(Paragraph([(f"{ts.label('payment')}: {days} {ts.clean('days')}. {ts.sentence(4, 12)}", "r")],
                           align="left"), lh * 1.2)
    if rng.random() < 0.5:
        flow.add(KeyValue([(ts.label("bank"), ts.company()), (ts.label("iban"), ts.iban())],
                          key_style=c.kv_key_style, aligned=rng.random() < 0.5), lh * 0.6)


def layout_form(c: Content, page: Page, frame: tuple[float, float, float, float]) -> None:
    x, y, w, bottom = frame
    rng, ts = c.rng, c.ts
    flow = Flow(page, [(x, w)], y, bottom)
    lh = c.typo.line_h()
    title = ts.title(2, 6)
    if rng.random() < 0.4:
        title = f"{title} ({ts.code('Form')})"
    if not flow.add(c.heading(1, title), 0):
        return
    if rng.random() < 0.7 and not flow.add(c.paragraph(1, 3), c.para_gap):
        return
    for _ in range(rng.randint(2, 5)):
        if not flow.add(c.heading(rng.choice([2, 3])), lh * rng.uniform(0.8, 1.4)):
            return
        r = rng.random()
        if r < 0.65:
            ok = flow.add(c.kv(rng.choice(["person", "generic"]), (2, 7), blanks=rng.uniform(0, 0.5)), lh * 0.5)
        elif r < 0.85:
            ok = flow.add(c.list_block(checkbox=True), lh * 0.5)
        else:
            ok = flow.add(c.paragraph(1, 3), lh * 0.5)
        if not ok:
            return
    flow.add(KeyValue([(ts.label("date"), ts.date() if rng.random() < 0.5 else ""), (ts.label("signature"), "")],
                      key_style=c.kv_key_style, aligned=False), lh * 1.5)


def layout_letter(c: Content, page: Page, frame: tuple[float, float, float, float]) -> None:
    x, y, w, bottom = frame
    rng, ts, typo = c.rng, c.ts, c.typo
    flow = Flow(page, [(x, w)], y, bottom)
    lh = typo.line_h()
    sender = [(ts.company() if rng.random() < 0.6 else ts.name(), "b")] + [(a, "r") for a in ts.address_lines()]
    if rng.random() < 0.5:
        sender.append((ts.email(), "r"))
    right = rng.random() < 0.5
    sw = w * 0.45
    if not flow.row([(Lines(sender, align="right" if right else "left", size=max(6, round(typo.size * 0.92))),
                      w - sw if right else 0, sw)]):
        return
    recipient = [(ts.name(), "r")] + ([(ts.company(), "r")] if rng.random() < 0.4 else []) + \
        [(a, "r") for a in ts.address_lines()]
    if not flow.add(Lines(recipient), lh * rng.uniform(1.5, 3.0)):
        return
    date_line = Lines([(f"{ts.city()}, {ts.date()}" if rng.random() < 0.5 else ts.date(), "r")], align="right")
    if not flow.add(date_line, lh * rng.uniform(1.0, 2.0)):
        return
    subj = ts.sentence(3, 9).rstrip(".")
    subj_runs = [(f"{ts.label('subject')}: {subj}", "b")] if rng.random() < 0.6 else [(subj, "b")]
    if not flow.add(Paragraph(subj_runs, align="left"), lh * rng.uniform(1.0, 2.0)):
        return
    sal = ts.label("dear")
    if sal == ts.clean("Dear"):  # the English salutation takes a name
        sal = f"{sal} {ts.name()}"
    if not flow.add(Paragraph([(sal + ",", "r")], align="left", indent=0), lh):
        return
    for _ in range(rng.randint(2, 5)):
        if not flow.add(c.paragraph(2, 5), c.para_gap):
            return
    closing = [(ts.label("regards") + ",", "r"), (ts.name(), "r")]
    if rng.random() < 0.6:
        closing.append((ts.job(), "r"))
    flow.add(Lines(closing), lh * 1.2)


_LAYOUT_FNS = {"article": layout_article, "two_column": layout_two_column, "report": layout_report,
               "invoice": layout_invoice, "form": layout_form, "letter": layout_letter}


# --------------------------------------------------------------------------- #
# The page
# --------------------------------------------------------------------------- #
def _page_size(rng: random.Random, cfg: PageConfig) -> tuple[int, int]:
    m = cfg.multiple_of
    if cfg.size is not None:
        w, h = cfg.size
        if w % m or h % m:
            raise ValueError(f"size {cfg.size} must be a multiple of {m}")
        return int(w), int(h)
    lo, hi = cfg.long_side
    long = rng.randint(math.ceil(lo / m), hi // m) * m
    short = max(m, round(long / rng.uniform(*cfg.aspect) / m) * m)
    return (long, short) if rng.random() < cfg.landscape else (short, long)


def _furniture(c: Content, page_no: int) -> tuple[Lines | None, list[Lines]]:
    rng, ts = c.rng, c.ts
    size = max(6, round(c.typo.size * rng.uniform(0.72, 0.88)))
    color = (90, 90, 90) if rng.random() < 0.5 else None
    header = None
    if rng.random() < 0.6:
        text = rng.choice([ts.company(), ts.title(2, 5), f"{ts.title(1, 3)} {ts.year}", ts.code()])
        header = Lines([(text, "i" if (c.typo.fam.has_italic and rng.random() < 0.3) else "r")],
                       align=rng.choice(["left", "right", "center"]), size=size, color=color)
    footers = []
    if rng.random() < 0.35:
        footers.append(Lines([(rng.choice([ts.company(), ts.email(), ts.title(2, 4)]), "r")],
                             align=rng.choice(["left", "center"]), size=size, color=color))
    if rng.random() < 0.85:
        total = page_no + rng.randint(0, 20)
        pat = rng.choice(["{n}", "{n}", "{page} {n}", "{page} {n} {of} {t}", "{n} / {t}", "{n}/{t}"])
        text = pat.format(n=page_no, t=total, page=ts.label("page"), of=ts.label("of"))
        footers.append(Lines([(text, "r")], align=rng.choice(["center", "right", "center"]), size=size, color=color))
    return header, footers


def _family(rng: random.Random, cfg: PageConfig) -> FontFamily:
    fams = available_families(cfg.fonts)
    if len(fams) == 1:
        return fams[0]
    # Pillow's ASCII-only font a fifth of the time, the system families share the rest
    return fams[0] if rng.random() < 0.2 else rng.choice(fams[1:])


def compose(seed: int, cfg: PageConfig) -> dict[str, Any]:
    """Lays out the page of `seed`: blocks, sizes and Markdown (nothing drawn yet)."""
    rng = random.Random(seed)
    layouts = cfg.layouts or LAYOUTS
    for name in ([cfg.layout] if cfg.layout else layouts):
        if name not in _LAYOUT_FNS:
            raise ValueError(f"unknown layout {name!r}; expected one of {LAYOUTS}")
    layout = cfg.layout or rng.choices(layouts, weights=[LAYOUT_WEIGHTS.get(n, 0.1) for n in layouts])[0]
    w, h = _page_size(rng, cfg)
    fam = _family(rng, cfg)
    locale = pick_locale(rng, cfg.locales)
    ts = TextSource(rng, locale, cfg.use_faker, fam.clean)
    scale = max(w, h) / 1024
    size = max(6, round(rng.uniform(*cfg.body_px) * scale * (0.9 if layout == "two_column" else 1.0)))
    dark = rng.randint(0, 60)
    ink = (dark, dark, min(255, dark + rng.choice([0, 0, 0, 25])))
    accent = ink if rng.random() < 0.6 else rng.choice([(20, 40, 110), (110, 20, 20), (20, 80, 40), (60, 60, 60)])
    light = rng.choice([(232, 232, 232), (220, 230, 242), (236, 240, 228), (245, 235, 225)])
    typo = Typo(fam, size, leading=rng.uniform(1.15, 1.5), ink=ink, accent=accent, light=light)
    c = Content(rng, ts, typo, w)
    page = Page(w, h, typo, cfg.max_chars if cfg.max_chars is not None else math.inf)

    mx = round(w * rng.uniform(0.06, 0.12))
    mt = round(h * rng.uniform(0.05, 0.09))
    mb = round(h * rng.uniform(0.05, 0.09))
    body_x, body_w = mx, w - 2 * mx
    top, bottom = mt, h - mb
    header: Any = None
    footers: list[Any] = []
    if rng.random() < cfg.furniture:
        header, footers = _furniture(c, rng.randint(1, 40))
    head_laid = header.layout(typo, body_w) if header else None
    foot_laids = [f.layout(typo, body_w) for f in footers]
    foot_laids = [f for f in foot_laids if f is not None]
    # page furniture within the character budget too (a small budget leaves room for the body first)
    if head_laid is not None and len(head_laid.md) + 2 > page.budget() / 2:
        head_laid = None
    while foot_laids and sum(len(f.md) + 2 for f in foot_laids) + (len(head_laid.md) + 2 if head_laid else 0) > page.budget() / 2:
        foot_laids.pop()
    if head_laid is not None:
        hy = max(2, mt - head_laid.h - round(typo.size * 0.6))
        page.place(body_x, hy, head_laid)
        if rng.random() < 0.4:
            c.header_rule = hy + head_laid.h + 2
        top = max(top, hy + head_laid.h + typo.size)
    foot_h = sum(f.h for f in foot_laids) + (typo.size // 2) * max(0, len(foot_laids) - 1)
    foot_y = max(0, h - max(2, round(mb * 0.45)) - foot_h)
    if foot_laids:
        bottom = min(bottom, foot_y - typo.size)
        page.chars_left -= sum(len(f.md) + 2 for f in foot_laids)
    n_before = len(page.placed)
    _LAYOUT_FNS[layout](c, page, (body_x, top, body_w, bottom))
    while len(page.placed) > n_before and page.placed[-1][2].kind == "heading":  # no heading at the very end
        page.placed.pop()
    if len(page.placed) == n_before:  # none of the layout's blocks fitted (small page, large type, small budget)
        Flow(page, [(body_x, body_w)], top, bottom).add(c.paragraph())
    if foot_laids:
        fy = foot_y
        for f in foot_laids:
            page.place(body_x, fy, f)
            fy += f.h + typo.size // 2
    blocks = [(x, y, laid) for x, y, laid in page.placed if laid.md]
    md = "\n\n".join(laid.md for _, _, laid in blocks)
    rules: list[tuple[str, float, float, float, float, tuple[int, int, int], int]] = []
    if c.header_rule is not None:
        rules.append(("l", body_x, c.header_rule, body_x + body_w, c.header_rule, (120, 120, 120), 1))
    if c.column_rule is not None:
        cx, cy0, cy1 = c.column_rule
        rules.append(("l", cx, cy0, cx, cy1, (150, 150, 150), 1))
    tables = [dict(laid.info) for _, _, laid in blocks if laid.kind == "table"]
    meta = {
        "seed": int(seed), "layout": layout, "width": w, "height": h, "font_family": fam.name, "body_px": size,
        "locale": locale, "faker": bool(cfg.use_faker and faker_available()),
        "blocks": [laid.kind for _, _, laid in blocks], "tables": tables, "chars": len(md),
    }
    return {"blocks": blocks, "rules": rules, "markdown": md, "meta": meta}


def generate_page(seed: int, config: PageConfig | None = None,
                  glyphs: bool = False) -> tuple[Image.Image | None, str, dict[str, Any]]:
    """The page of `seed`: (RGB image, its Markdown, meta). Deterministic for a seed and a machine's fonts.

    meta: seed, layout, width, height, font_family, body_px, locale, faker, blocks (kinds in reading
    order), tables (rows / cols / header / style of each, in order), chars, noise (what was applied);
    with `glyphs`, also glyphs: [x, y, character] of every visible character drawn, its centre in the
    final image's pixels (after the scan noise's rotation).
    """
    cfg = config or PageConfig()
    seed = int(seed)
    if seed < 0:
        raise ValueError("seed must be >= 0")
    doc = compose(seed, cfg)
    meta = doc["meta"]
    if not cfg.render:
        meta["noise"] = {}
        return None, doc["markdown"], meta
    img = Image.new("RGB", (meta["width"], meta["height"]), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    draw_ops(draw, doc["rules"])
    for x, y, laid in doc["blocks"]:
        draw_ops(draw, shift_ops(laid.ops, x, y))
    img, info = scan_noise(img, np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, 7]), cfg.noise)
    meta["noise"] = info
    if glyphs:
        centres = [g for x, y, laid in doc["blocks"] for g in text_glyphs(shift_ops(laid.ops, x, y))]
        meta["glyphs"] = [[round(gx, 1), round(gy, 1), ch] for gx, gy, ch in
                          rotate_points(centres, info.get("rotate", 0.0), meta["width"], meta["height"])]
    return img, doc["markdown"], meta


def rotate_points(points: list[tuple[float, float, str]], angle: float, w: int, h: int) -> list[tuple[float, float, str]]:
    """Where Image.rotate(angle) (degrees, counter-clockwise about the centre, size kept) moves points of a
    w x h image: with y pointing down, (dx, dy) -> (dx cos a + dy sin a, -dx sin a + dy cos a)."""
    if not angle:
        return points
    a = math.radians(angle)
    c, s = math.cos(a), math.sin(a)
    cx, cy = w / 2, h / 2
    return [(cx + (x - cx) * c + (y - cy) * s, cy - (x - cx) * s + (y - cy) * c, ch) for x, y, ch in points]


def with_overrides(cfg: PageConfig | None, **kw: Any) -> PageConfig:
    return replace(cfg or PageConfig(), **kw)
