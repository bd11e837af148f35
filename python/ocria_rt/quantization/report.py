"""The quantization report as a table, and its KL figure as a PNG drawn with Pillow."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

FORMAT_COLOURS = {"fp8": (52, 101, 164), "nvfp4": (230, 126, 34), "dense": (150, 150, 150)}


def format_table(report: dict[str, Any]) -> str:
    """Per group: the format chosen, the KL each format gives alone, and bytes; then the totals."""
    groups = report["groups"]
    kinds = [f for f in ("fp8", "nvfp4") if any(f in g["kl"] for g in groups)]
    width = max([len(g["name"]) for g in groups] + [5])
    head = f"{'group':<{width}}  {'format':<6}" + "".join(f"  {'KL ' + f:>10}" for f in kinds) + f"  {'bytes':>12}  {'of BF16':>7}"
    lines = [head, "-" * len(head)]
    for g in groups:
        kl = "".join(f"  {g['kl'][f]:>10.2e}" if f in g["kl"] else f"  {'-':>10}" for f in kinds)
        lines.append(f"{g['name']:<{width}}  {g['format']:<6}{kl}  {g['bytes']:>12,}  {g['bytes'] / g['bf16_bytes']:>7.1%}")
    t = report["total"]
    lines.append("-" * len(head))
    lines.append(f"{'total':<{width}}  {report['quant_algo']:<6}  {t['bytes']:,} bytes = {t['fraction_of_bf16']:.1%} of "
                 f"BF16's {t['bf16_bytes']:,} ({t['bits_per_weight']:.2f} bits per weight)")
    lines.append(f"KL per continuation token: {t['summed_kl']:.3e} summed over the groups alone, "
                 f"{t['measured_kl']:.3e} measured with the checkpoint written")
    return "\n".join(lines)


def _vertical_text(img: Any, xy: tuple[int, int], text: str, font: Any) -> None:
    """text drawn bottom to top, its top-left corner at xy."""
    from PIL import Image, ImageDraw

    left, top, right, bottom = font.getbbox(text)
    tile = Image.new("RGBA", (right + 2, bottom + 2), (255, 255, 255, 0))
    ImageDraw.Draw(tile).text((1, 0), text, fill="black", font=font)
    tile = tile.rotate(90, expand=True)
    img.paste(tile, xy, tile)


def write_kl_plot(path: Path, report: dict[str, Any]) -> None:
    """KL divergence (log scale) of each group quantized alone, per format, in layer order; the square
    under each group is the format chosen."""
    from PIL import Image, ImageDraw, ImageFont

    groups = report["groups"]
    kinds = [f for f in ("fp8", "nvfp4") if any(f in g["kl"] for g in groups)]
    values = [g["kl"][f] for g in groups for f in kinds if f in g["kl"] and g["kl"][f] > 0]
    lo = math.floor(math.log10(min(values))) if values else -6
    hi = math.ceil(math.log10(max(values))) if values else 0
    hi = max(hi, lo + 1)
    bar, gap = 7, 6
    left, right, top, bottom = 70, 20, 40, 110
    plot_w = len(groups) * (len(kinds) * bar + gap)
    w, h = left + plot_w + right, top + 320 + bottom
    img = Image.new("RGB", (max(w, 480), h), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    y0, y1 = top, top + 320

    def y_of(v: float) -> float:
        return y1 - (math.log10(v) - lo) / (hi - lo) * (y1 - y0)

    d.text((left, 10), f"{report['model_name']}: KL of each projection group quantized alone (log scale)", fill="black",
           font=font)
    for e in range(lo, hi + 1):
        y = y_of(10.0**e)
        d.line([(left, y), (left + plot_w, y)], fill=(225, 225, 225))
        d.text((8, y - 6), f"1e{e}", fill="black", font=font)
    d.line([(left, y0), (left, y1), (left + plot_w, y1)], fill="black")
    x = left + gap // 2
    for g in groups:
        for i, f in enumerate(kinds):
            v = g["kl"].get(f)
            if v is not None and v > 0:
                d.rectangle([x + i * bar, y_of(max(v, 10.0**lo)), x + (i + 1) * bar - 2, y1], fill=FORMAT_COLOURS[f])
        gx = x + (len(kinds) * bar) // 2
        d.rectangle([gx - 4, y1 + 5, gx + 3, y1 + 12], fill=FORMAT_COLOURS[g["format"]])
        _vertical_text(img, (gx - 6, y1 + 16), g["short"], font)
        x += len(kinds) * bar + gap
    lx = left
    for f in kinds + ["dense"]:
        d.rectangle([lx, h - 18, lx + 10, h - 8], fill=FORMAT_COLOURS[f])
        d.text((lx + 14, h - 20), {"fp8": "FP8", "nvfp4": "NVFP4", "dense": "unquantized"}[f], fill="black", font=font)
        lx += 110
    d.text((lx, h - 20), "bars: KL alone; squares: format chosen", fill="black", font=font)
    img.save(path, format="PNG")
