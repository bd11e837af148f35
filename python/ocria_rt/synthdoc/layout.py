"""Typesetting: blocks of content laid out into draw operations, each with its exact Markdown.

A block's ``layout(width, max_h, max_chars)`` returns a :class:`Laid` (its height, the draw operations
relative to its top-left corner, and its Markdown) or None when not even the smallest useful part of
it fits. Blocks shrink to fit: a paragraph keeps the lines that fit, a list or key-value block the
items that fit, a table the rows that fit, so a page fills up to its bottom margin; the Markdown is
always built from what was kept, never from what was meant.

Markdown conventions (the ground truth the model learns):
- headings ``#``/``##``/``###``; paragraphs as one line of text (drawn line breaks are spaces);
  bold ``**x**``, italic ``*x*``, bold-italic ``***x***`` where the text is drawn so;
- lists ``- item`` / ``1. item`` / ``1) item`` (as drawn), checkboxes ``- [x] item`` / ``- [ ] item``;
  nested items indented to the parent's content column;
- tables as one line of HTML: ``<table><tr><th>..</th></tr><tr><td>..</td></tr></table>`` (``<th>``
  where the header row is drawn, cell text HTML-escaped, wrapped cell text joined with spaces);
- key-value lines ``**Key:** value`` (``Key: value`` when the key is not bold) and other line-based
  blocks (addresses, running headers) one drawn line per Markdown line;
- blocks are separated by a blank line, in reading order.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .fonts import FontFamily

Run = tuple[str, str]  # (text, style), style in {"r", "b", "i", "bi"}
Color = tuple[int, int, int]


# --------------------------------------------------------------------------- #
# Draw operations
# --------------------------------------------------------------------------- #
# ("t", x, baseline_y, text, font, bold, fill) | ("l", x0, y0, x1, y1, fill, width)
#   (bold < 0: faux bold, the text drawn twice |bold| px apart)
# ("r", x0, y0, x1, y1, fill | None, outline | None, width) | ("e", x0, y0, x1, y1, fill | None, outline | None)
Op = tuple


def shift_ops(ops: list[Op], dx: float, dy: float) -> list[Op]:
    out = []
    for op in ops:
        k = op[0]
        if k == "t":
            out.append((k, op[1] + dx, op[2] + dy) + op[3:])
        else:
            out.append((k, op[1] + dx, op[2] + dy, op[3] + dx, op[4] + dy) + op[5:])
    return out


def draw_ops(draw: Any, ops: list[Op]) -> None:
    """Executes operations on a PIL.ImageDraw.Draw."""
    for op in ops:
        k = op[0]
        if k == "t":
            _, x, y, text, font, bold, fill = op
            draw.text((round(x), round(y)), text, font=font, fill=fill, anchor="ls")
            if bold < 0:  # faux bold: drawn again, shifted right
                draw.text((round(x) - bold, round(y)), text, font=font, fill=fill, anchor="ls")
        elif k == "l":
            _, x0, y0, x1, y1, fill, width = op
            draw.line([(round(x0), round(y0)), (round(x1), round(y1))], fill=fill, width=width)
        elif k == "r":
            _, x0, y0, x1, y1, fill, outline, width = op
            draw.rectangle([round(x0), round(y0), round(x1), round(y1)], fill=fill, outline=outline, width=width)
        elif k == "e":
            _, x0, y0, x1, y1, fill, outline = op
            draw.ellipse([round(x0), round(y0), round(x1), round(y1)], fill=fill, outline=outline)


def text_glyphs(ops: list[Op]) -> list[tuple[float, float, str]]:
    """The centre (x, y) of every visible character that the text operations of `ops` draw, as draw_ops
    places them (x advanced by the font's length of the text before it, y from the glyph's box about the
    baseline): the per-character ground truth of where the text is on the page."""
    out: list[tuple[float, float, str]] = []
    for op in ops:
        if op[0] != "t":
            continue
        _, x, y, text, font, _bold, _fill = op
        x0, base = round(x), round(y)
        for i, ch in enumerate(text):
            if ch.isspace():
                continue
            left, top, right, bottom = font.getbbox(ch, anchor="ls")
            out.append((x0 + font.getlength(text[:i]) + (left + right) / 2, base + (top + bottom) / 2, ch))
    return out


@dataclass
class Laid:
    """A laid-out block: size, draw operations (relative to its top-left) and Markdown."""

    w: int
    h: int
    ops: list[Op]
    md: str
    kind: str
    info: dict[str, Any] = field(default_factory=dict)
    complete: bool = True  # False when the block was cut to fit (height or character budget)


# --------------------------------------------------------------------------- #
# Typography
# --------------------------------------------------------------------------- #
@dataclass
class Typo:
    """A page's typography: family, body size, leading, colours."""

    fam: FontFamily
    size: int
    leading: float = 1.3
    ink: Color = (20, 20, 20)
    accent: Color = (20, 20, 20)
    light: Color = (235, 235, 235)

    def face(self, style: str, size: int | None = None):
        return self.fam.face(style, size or self.size)

    def line_h(self, size: int | None = None) -> int:
        return max(1, round((size or self.size) * self.leading))

    def width(self, text: str, style: str, size: int | None = None) -> float:
        font, bold = self.face(style, size)
        return font.getlength(text) + abs(bold)

    def baseline(self, size: int | None = None) -> int:
        """Offset of the baseline from the top of a line box."""
        s = size or self.size
        font, _ = self.face("r", s)
        asc, desc = font.getmetrics()
        lh = self.line_h(s)
        return round((lh - (asc + desc)) / 2 + asc)


# A laid word: (text, style, width, space_before)
Word = tuple[str, str, float, bool]


def split_runs(runs: list[Run]) -> list[tuple[str, str, bool]]:
    """Runs -> words (text, style, space_before). Runs meet at word boundaries: every word but the
    first has a space before it."""
    out: list[tuple[str, str, bool]] = []
    for text, style in runs:
        for p in text.split(" "):
            if p:
                out.append((p, style, bool(out)))
    return out


def wrap(runs: list[Run], width: float, typo: Typo, size: int | None = None, indent: float = 0.0) -> list[list[Word]]:
    """Greedy line breaking (the first line `indent` px narrower); a word wider than the line is
    broken between characters."""
    lines: list[list[Word]] = []
    cur: list[Word] = []
    cur_w = 0.0
    space = typo.width(" ", "r", size)
    for text, style, sp in split_runs(runs):
        w = typo.width(text, style, size)
        pieces = [(text, w, sp)]
        if w > width:  # break a too-long word into pieces that fit a line
            pieces = []
            buf, first = "", True
            for ch in text:
                if buf and typo.width(buf + ch, style, size) > width:
                    pieces.append((buf, typo.width(buf, style, size), sp if first else False))
                    buf, first = "", False
                buf += ch
            pieces.append((buf, typo.width(buf, style, size), sp if first else False))
        for ptext, pw, psp in pieces:
            gap = space if (cur and psp) else 0.0
            if cur and cur_w + gap + pw > width - (indent if not lines else 0.0):
                lines.append(cur)
                cur, cur_w, gap = [], 0.0, 0.0
            cur.append((ptext, style, pw, psp))
            cur_w += gap + pw
    if cur:
        lines.append(cur)
    return lines


_MARK = {"r": "", "b": "**", "i": "*", "bi": "***"}
_LIST_START = re.compile(r"^(\d{1,9})([.)]) ")


def escape_line_start(line: str) -> str:
    """A line of text that Markdown would read as a numbered-list item ("12. April 2009") gets its
    marker escaped ("12\\. April 2009"), so that the Markdown renders as drawn."""
    return _LIST_START.sub(lambda m: f"{m.group(1)}\\{m.group(2)} ", line, count=1)


def md_words(words: list[Word], emphasis: bool = True) -> str:
    """Markdown of laid words: consecutive words of one style share one pair of emphasis markers."""
    out: list[str] = []
    i = 0
    while i < len(words):
        style = words[i][1] if emphasis else "r"
        j = i
        seg = ""
        while j < len(words) and (not emphasis or words[j][1] == style):
            seg += (" " if (j > i and words[j][3]) else "") + words[j][0]
            j += 1
        sep = " " if (i > 0 and words[i][3]) else ""
        m = _MARK.get(style, "")
        out.append(sep + m + seg + m)
        i = j
    return "".join(out)


def line_ops(line: list[Word], x: float, y_base: float, width: float, typo: Typo, size: int | None,
             align: str, last: bool, fill: Color) -> list[Op]:
    """Draw operations for one line of words starting at x (baseline y_base)."""
    space = typo.width(" ", "r", size)
    gaps = [space if (k > 0 and w[3]) else 0.0 for k, w in enumerate(line)]
    natural = sum(w[2] for w in line) + sum(gaps)
    extra = 0.0
    if align == "justify" and not last:
        n_gaps = sum(1 for g in gaps if g > 0)
        if n_gaps and width > natural:
            extra = (width - natural) / n_gaps
    elif align == "center":
        x += (width - natural) / 2
    elif align == "right":
        x += width - natural
    ops: list[Op] = []
    if extra == 0.0:  # one draw call per run of one style
        k = 0
        while k < len(line):
            style = line[k][1]
            j, text = k, ""
            start = x + (gaps[k] if k else 0.0)
            seg_w = 0.0
            while j < len(line) and line[j][1] == style:
                if j > k:
                    text += " " if line[j][3] else ""
                    seg_w += gaps[j]
                text += line[j][0]
                seg_w += line[j][2]
                j += 1
            font, bold = typo.face(style, size)
            ops.append(("t", start, y_base, text, font, bold, fill))
            x = start + seg_w
            k = j
        return ops
    for k, w in enumerate(line):
        if k:
            x += gaps[k] + (extra if gaps[k] > 0 else 0.0)
        font, bold = typo.face(w[1], size)
        ops.append(("t", x, y_base, w[0], font, bold, fill))
        x += w[2]
    return ops


# --------------------------------------------------------------------------- #
# Blocks
# --------------------------------------------------------------------------- #
class Block:
    kind = "block"

    def layout(self, typo: Typo, width: int, max_h: float = math.inf, max_chars: float = math.inf) -> Laid | None:
        raise NotImplementedError


@dataclass
class Paragraph(Block):
    runs: list[Run]
    align: str = "left"  # left | justify | center | right
    size: int | None = None
    indent: int = 0  # first-line indent in px
    color: Color | None = None
    kind: str = "paragraph"
    truncatable: bool = True

    def layout(self, typo, width, max_h=math.inf, max_chars=math.inf):
        size = self.size or typo.size
        lh = typo.line_h(size)
        lines = wrap(self.runs, width, typo, size, indent=self.indent)
        n = total = len(lines)
        if lh * n > max_h:
            if not self.truncatable:
                return None
            n = int(max_h // lh)
        while n > 0 and len(md_words([w for ln in lines[:n] for w in ln])) > max_chars:
            if not self.truncatable:
                return None
            n -= 1
        cut = False
        if n == 0 and self.truncatable and lines and lh <= max_h:
            # not even the first line fits the character budget (small pages, large type): the longest
            # run of its words that does, so that a small budget still gives the page some text
            k = len(lines[0])
            while k > 0 and len(md_words(lines[0][:k])) > max_chars:
                k -= 1
            lines, n, cut = [lines[0][:k]], 1 if k else 0, True
        if n <= 0:
            return None
        lines = lines[:n]
        base = typo.baseline(size)
        ops: list[Op] = []
        fill = self.color or typo.ink
        for i, ln in enumerate(lines):
            x = self.indent if i == 0 else 0
            ops += line_ops(ln, x, i * lh + base, width - x, typo, size, self.align, i == len(lines) - 1, fill)
        md = escape_line_start(md_words([w for ln in lines for w in ln]))
        return Laid(width, lh * n, ops, md, self.kind, {"lines": n}, complete=n == total and not cut)


@dataclass
class Heading(Block):
    text: str
    level: int
    size: int
    align: str = "left"
    style: str = "b"
    color: Color | None = None
    rule: bool = False  # a line under the heading (decoration)
    kind: str = "heading"

    def layout(self, typo, width, max_h=math.inf, max_chars=math.inf):
        lh = typo.line_h(self.size)
        lines = wrap([(self.text, self.style)], width, typo, self.size)
        h = lh * len(lines) + (max(2, self.size // 4) if self.rule else 0)
        md = "#" * self.level + " " + md_words([w for ln in lines for w in ln], emphasis=False)
        if h > max_h or len(md) > max_chars or len(lines) > 3:
            return None
        base = typo.baseline(self.size)
        fill = self.color or typo.accent
        ops: list[Op] = []
        for i, ln in enumerate(lines):
            ops += line_ops(ln, 0, i * lh + base, width, typo, self.size, self.align, True, fill)
        if self.rule:
            y = lh * len(lines) + 1
            ops.append(("l", 0, y, width, y, fill, max(1, self.size // 14)))
        return Laid(width, h, ops, md, self.kind, {"level": self.level})


@dataclass
class ListItem:
    runs: list[Run]
    level: int = 0
    checked: bool | None = None  # a checkbox item when not None


@dataclass
class ListBlock(Block):
    items: list[ListItem]
    ordered: bool = False
    start: int = 1
    marker: str = "disc"  # disc | circle | square | dash (bullets); "." or ")" (numbers)
    size: int | None = None
    item_gap: float = 0.25  # in line heights
    indent: float = 1.6  # nesting indent in body sizes
    kind: str = "list"

    def _marker_text(self, n: int) -> str:
        return f"{n}{self.marker}"

    def layout(self, typo, width, max_h=math.inf, max_chars=math.inf):
        size = self.size or typo.size
        lh = typo.line_h(size)
        gap = round(lh * self.item_gap)
        base = typo.baseline(size)
        font, _ = typo.face("r", size)
        if self.ordered:
            last_n = self.start + sum(1 for it in self.items if it.level == 0) - 1
            num_w = typo.width(self._marker_text(max(last_n, 9)), "r", size) + size * 0.45
        else:
            num_w = size * 1.1
        box = round(size * 0.72)
        nest = round(size * self.indent)
        ops: list[Op] = []
        md_lines: list[str] = []
        y = 0.0
        n = self.start
        chars = 0
        kept = 0
        parent_prefix = ""
        for item in self.items:
            lvl = item.level
            x0 = lvl * nest + (0 if lvl == 0 else round(num_w if self.ordered else 0))
            mark_w = num_w if (self.ordered and lvl == 0) else size * 1.1
            if item.checked is not None:  # a checkbox replaces the bullet
                mark_w = 0
            cb_w = box + size * 0.45 if item.checked is not None else 0
            tx = x0 + mark_w + cb_w
            lines = wrap(item.runs, max(size * 4, width - tx), typo, size)
            h = lh * len(lines)
            if self.ordered and lvl == 0:
                prefix = f"{n}{self.marker} "
                parent_prefix = prefix
            else:
                prefix = "- "
            indent = "" if lvl == 0 else " " * len(parent_prefix if self.ordered else "- ")
            cb = "" if item.checked is None else ("[x] " if item.checked else "[ ] ")
            line_md = indent + prefix + cb + md_words([w for ln in lines for w in ln])
            add = len(line_md) + (1 if md_lines else 0)
            if y + h > max_h or chars + add > max_chars:
                break
            # marker
            yb = y + base
            cx = x0 + size * 0.35
            cy = y + base - size * 0.33
            if item.checked is not None:
                pass
            elif self.ordered and lvl == 0:
                mt = self._marker_text(n)
                ops.append(("t", x0 + num_w - size * 0.45 - typo.width(mt, "r", size), yb, mt, font, 0, typo.ink))
                n += 1
            else:
                m = self.marker if lvl == 0 else {"disc": "circle", "circle": "dash", "square": "dash"}.get(self.marker, "dash")
                r = max(1.5, size * 0.16)
                if m == "disc":
                    ops.append(("e", cx - r, cy - r, cx + r, cy + r, typo.ink, None))
                elif m == "circle":
                    ops.append(("e", cx - r, cy - r, cx + r, cy + r, None, typo.ink))
                elif m == "square":
                    ops.append(("r", cx - r, cy - r, cx + r, cy + r, typo.ink, None, 1))
                else:
                    ops.append(("l", cx - r * 1.3, cy, cx + r * 1.3, cy, typo.ink, max(1, size // 12)))
            if item.checked is not None:
                bx = x0 + mark_w
                by = y + base - box
                ops.append(("r", bx, by, bx + box, by + box, None, typo.ink, max(1, size // 14)))
                if item.checked:
                    wdt = max(1, size // 9)
                    ops.append(("l", bx + box * 0.2, by + box * 0.55, bx + box * 0.42, by + box * 0.8, typo.ink, wdt))
                    ops.append(("l", bx + box * 0.42, by + box * 0.8, bx + box * 0.85, by + box * 0.18, typo.ink, wdt))
            for i, ln in enumerate(lines):
                ops += line_ops(ln, tx, y + i * lh + base, width - tx, typo, size, "left", True, typo.ink)
            md_lines.append(line_md)
            chars += add
            kept += 1
            y += h + gap
        if kept == 0:
            return None
        return Laid(width, round(y - gap), ops, "\n".join(md_lines), self.kind,
                    {"items": kept, "ordered": self.ordered, "checkbox": any(it.checked is not None for it in self.items)},
                    complete=kept == len(self.items))


@dataclass
class KeyValue(Block):
    pairs: list[tuple[str, str]]
    key_style: str = "b"
    sep: str = ":"
    aligned: bool = True
    size: int | None = None
    row_gap: float = 0.2
    blank_line: bool = True  # draw a rule where the value is empty (a form field)
    kind: str = "keyvalue"

    def layout(self, typo, width, max_h=math.inf, max_chars=math.inf):
        size = self.size or typo.size
        lh = typo.line_h(size)
        base = typo.baseline(size)
        gap = round(lh * self.row_gap)
        keys = [k + self.sep for k, _ in self.pairs]
        key_w = max(typo.width(k, self.key_style, size) for k in keys) + size * 0.8
        key_w = min(key_w, width * 0.5)
        ops: list[Op] = []
        md_lines: list[str] = []
        y = 0.0
        chars = 0
        for key, (_, value) in zip(keys, self.pairs):
            if self.aligned:
                klines = wrap([(key, self.key_style)], key_w - size * 0.5, typo, size)
                vlines = wrap([(value, "r")], width - key_w, typo, size) if value else []
                h = lh * max(len(klines), len(vlines), 1)
            else:
                runs = [(key, self.key_style)] + ([(" " + value, "r")] if value else [])
                vlines = wrap(runs, width, typo, size)
                klines = []
                h = lh * len(vlines)
            mk = _MARK[self.key_style]
            line_md = escape_line_start(f"{mk}{key}{mk}" + (f" {value}" if value else ""))
            add = len(line_md) + (1 if md_lines else 0)
            if y + h > max_h or chars + add > max_chars:
                break
            if self.aligned:
                for i, ln in enumerate(klines):
                    ops += line_ops(ln, 0, y + i * lh + base, key_w, typo, size, "left", True, typo.ink)
                for i, ln in enumerate(vlines):
                    ops += line_ops(ln, key_w, y + i * lh + base, width - key_w, typo, size, "left", True, typo.ink)
                if not value and self.blank_line:
                    ops.append(("l", key_w, y + base + 2, width, y + base + 2, typo.ink, 1))
            else:
                for i, ln in enumerate(vlines):
                    ops += line_ops(ln, 0, y + i * lh + base, width, typo, size, "left", True, typo.ink)
                if not value and self.blank_line:
                    x = typo.width(key, self.key_style, size) + size * 0.5
                    ops.append(("l", x, y + base + 2, width, y + base + 2, typo.ink, 1))
            md_lines.append(line_md)
            chars += add
            y += h + gap
        if not md_lines:
            return None
        return Laid(width, round(y - gap), ops, "\n".join(md_lines), self.kind, {"pairs": len(md_lines)},
                    complete=len(md_lines) == len(self.pairs))


@dataclass
class Lines(Block):
    """Lines drawn one under the other (an address, a signature block, a running header)."""

    lines: list[Run]
    align: str = "left"
    size: int | None = None
    color: Color | None = None
    kind: str = "lines"
    truncatable: bool = False

    def layout(self, typo, width, max_h=math.inf, max_chars=math.inf):
        size = self.size or typo.size
        lh = typo.line_h(size)
        base = typo.baseline(size)
        ops: list[Op] = []
        md_lines: list[str] = []
        y = 0
        chars = 0
        for run in self.lines:
            wl = wrap([run], width, typo, size)
            md = escape_line_start(md_words([w for ln in wl for w in ln]))
            add = len(md) + (1 if md_lines else 0)
            if y + lh * len(wl) > max_h or chars + add > max_chars:
                if not self.truncatable or not md_lines:
                    return None
                break
            for ln in wl:
                ops += line_ops(ln, 0, y + base, width, typo, size, self.align, True, self.color or typo.ink)
                y += lh
            md_lines.append(md)
            chars += add
        if not md_lines:
            return None
        return Laid(width, y, ops, "\n".join(md_lines), self.kind, {"lines": len(md_lines)},
                    complete=len(md_lines) == len(self.lines))


TABLE_STYLES = ("grid", "rules", "zebra", "plain", "dark_header", "outer")


@dataclass
class Table(Block):
    header: list[str] | None
    rows: list[list[str]]
    numeric: list[bool]
    style: str = "grid"
    size: int | None = None
    min_size: int = 9
    stretch: bool = False  # widen the columns to the full width
    header_align: str = "left"  # left | center | same (as the column)
    head_fill: bool = False  # a light background behind the header row
    kind: str = "table"

    def _cols(self) -> int:
        return len(self.header) if self.header else len(self.rows[0])

    def _widths(self, typo: Typo, width: int, size: int) -> list[float] | None:
        pad = max(3, round(size * 0.4))
        ncol = self._cols()
        nat = [0.0] * ncol
        mins = [0.0] * ncol
        all_rows = ([self.header] if self.header else []) + self.rows
        for r_i, row in enumerate(all_rows):
            style = "b" if (self.header and r_i == 0) else "r"
            for c, cell in enumerate(row):
                nat[c] = max(nat[c], typo.width(cell, style, size))
                for wd in cell.split(" "):
                    mins[c] = max(mins[c], typo.width(wd, style, size))
        nat = [n + 2 * pad for n in nat]
        mins = [m + 2 * pad for m in mins]
        if sum(nat) <= width:
            if self.stretch:
                extra = width - sum(nat)
                return [n + extra * n / sum(nat) for n in nat]
            return nat
        if sum(mins) > width:
            return None
        extra = width - sum(mins)
        slack = [n - m for n, m in zip(nat, mins)]
        total = sum(slack) or 1.0
        return [m + extra * s / total for m, s in zip(mins, slack)]

    def layout(self, typo, width, max_h=math.inf, max_chars=math.inf):
        size = self.size or typo.size
        widths = None
        while size >= self.min_size:
            widths = self._widths(typo, width, size)
            if widths is not None:
                break
            size -= 1
        if widths is None:
            return None
        pad = max(3, round(size * 0.4))
        lh = typo.line_h(size)
        base = typo.baseline(size)
        tw = sum(widths)
        xs = [0.0]
        for w in widths:
            xs.append(xs[-1] + w)
        all_rows = ([(self.header, True)] if self.header else []) + [(r, False) for r in self.rows]
        ops: list[Op] = []
        bg: list[Op] = []
        html_rows: list[str] = []
        y = 0.0
        row_bounds = [0.0]
        chars = len("<table></table>")
        body = 0
        line_w = max(1, size // 14)
        for r_i, (row, is_head) in enumerate(all_rows):
            style = "b" if is_head else "r"
            cell_lines = [wrap([(cell, style)], widths[c] - 2 * pad + 0.01, typo, size) if cell else []
                          for c, cell in enumerate(row)]
            h = lh * max(1, max(len(cl) for cl in cell_lines)) + 2 * pad
            tag = "th" if is_head else "td"
            cells_md = [md_words([w for ln in cl for w in ln], emphasis=False) for cl in cell_lines]
            row_md = "<tr>" + "".join(f"<{tag}>{html.escape(c, quote=False)}</{tag}>" for c in cells_md) + "</tr>"
            if y + h > max_h or chars + len(row_md) > max_chars:
                break
            fill_text = typo.ink
            if is_head and self.style == "dark_header":
                bg.append(("r", 0, y, tw, y + h, typo.accent, None, 1))
                fill_text = (255, 255, 255)
            elif is_head and (self.style == "zebra" or self.head_fill):
                bg.append(("r", 0, y, tw, y + h, typo.light, None, 1))
            elif not is_head and self.style == "zebra" and body % 2 == 1:
                bg.append(("r", 0, y, tw, y + h, _tint(typo.light), None, 1))
            for c, cl in enumerate(cell_lines):
                align = "right" if self.numeric[c] else "left"
                if is_head and self.header_align != "same":
                    align = self.header_align
                for i, ln in enumerate(cl):
                    ops += line_ops(ln, xs[c] + pad, y + pad + i * lh + base, widths[c] - 2 * pad, typo, size,
                                    align, True, fill_text)
            html_rows.append(row_md)
            chars += len(row_md)
            if not is_head:
                body += 1
            y += h
            row_bounds.append(y)
        if body == 0 or len(html_rows) < 2:  # a table cut down to one row is not worth placing
            return None
        th = y
        ink = typo.ink
        n_head = 1 if self.header else 0
        if self.style == "grid":
            for yy in row_bounds:
                ops.append(("l", 0, yy, tw, yy, ink, line_w))
            for xx in xs:
                ops.append(("l", xx, 0, xx, th, ink, line_w))
        elif self.style == "outer":
            ops.append(("r", 0, 0, tw, th, None, ink, line_w))
            if n_head:
                ops.append(("l", 0, row_bounds[1], tw, row_bounds[1], ink, line_w))
        elif self.style == "rules":
            ops.append(("l", 0, 0, tw, 0, ink, line_w + 1))
            if n_head:
                ops.append(("l", 0, row_bounds[1], tw, row_bounds[1], ink, line_w))
            ops.append(("l", 0, th, tw, th, ink, line_w + 1))
        elif self.style == "plain" and n_head:
            ops.append(("l", 0, row_bounds[1], tw, row_bounds[1], ink, line_w))
        elif self.style == "zebra":
            ops.append(("l", 0, th, tw, th, ink, line_w))
        ncols = self._cols()
        md = "<table>" + "".join(html_rows) + "</table>"
        return Laid(round(tw), round(th) + line_w, bg + ops, md, self.kind,
                    {"rows": len(html_rows), "cols": ncols, "header": bool(self.header), "font_px": size,
                     "style": self.style}, complete=len(html_rows) == len(all_rows))


def _tint(c: Color | None) -> Color:
    if c is None:
        return (242, 242, 242)
    return tuple(min(255, v + (255 - v) // 2) for v in c)  # type: ignore[return-value]
