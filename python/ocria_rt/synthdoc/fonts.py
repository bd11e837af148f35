"""Fonts for synthetic pages: Pillow's bundled FreeType font, plus families found on the machine.

Nothing is ever downloaded. The families are looked up by file name in the usual font folders
(``/usr/share/fonts``, ``/usr/local/share/fonts``, ``~/.fonts``, ``~/.local/share/fonts``), in the
``ttf`` folder that matplotlib ships (located without importing matplotlib) and in the folders named
by ``OCRIA_SYNTHDOC_FONT_DIRS`` (``os.pathsep``-separated). Pillow's own font (``load_default(size)``,
Aileron Regular, Pillow >= 10.1 with FreeType) is always there, so the generator works with Pillow
alone; it covers ASCII only, so text drawn with it is transliterated (see :func:`FontFamily.clean`).

A family has a regular face and, where the files exist, bold / italic / bold-italic faces. A missing
bold face is drawn with the regular face and a one-pixel stroke ("faux bold"); a missing italic face
makes the family report ``has_italic = False`` and the generator then uses no italics with it.

Which families exist depends on the machine, and so does a page: the family of a seed is drawn from
the families found, and a family's glyph widths decide line breaks, hence where the character budget
ends the text, and which characters are transliterated. ``PageConfig(fonts="pillow")`` restricts a
page to Pillow's font (the same wherever Pillow is). ``PageConfig(fonts=(names...))`` draws from the
named families in that order, as a machine that had exactly those would (:func:`family_records`
names them and digests their files); a named family missing here is drawn with a found one of its
kind (serif, sans-serif, monospace; else Pillow's font), so only the pages that fall to it differ.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from PIL import ImageFont, features

#: Characters the generator may emit; a face's charset is the subset of these it has glyphs for.
CANDIDATE_CHARS = (
    "".join(chr(c) for c in range(0x20, 0x7F))
    + "".join(chr(c) for c in range(0xA0, 0x180) if c != 0xAD)
    + "€•–—‘’“”…№©°±×"
)

# family name -> (regular, bold, italic, bold-italic) file names; the first found regular wins.
KNOWN_FAMILIES: dict[str, tuple[str, str | None, str | None, str | None]] = {
    "DejaVu Sans": ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf"),
    "DejaVu Sans Condensed": ("DejaVuSansCondensed.ttf", "DejaVuSansCondensed-Bold.ttf",
                              "DejaVuSansCondensed-Oblique.ttf", "DejaVuSansCondensed-BoldOblique.ttf"),
    "DejaVu Serif": ("DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf"),
    "DejaVu Serif Condensed": ("DejaVuSerifCondensed.ttf", "DejaVuSerifCondensed-Bold.ttf",
                               "DejaVuSerifCondensed-Italic.ttf", "DejaVuSerifCondensed-BoldItalic.ttf"),
    "DejaVu Sans Mono": ("DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
                         "DejaVuSansMono-BoldOblique.ttf"),
    "STIX General": ("STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf"),
    "Liberation Sans": ("LiberationSans-Regular.ttf", "LiberationSans-Bold.ttf", "LiberationSans-Italic.ttf",
                        "LiberationSans-BoldItalic.ttf"),
    "Liberation Serif": ("LiberationSerif-Regular.ttf", "LiberationSerif-Bold.ttf", "LiberationSerif-Italic.ttf",
                         "LiberationSerif-BoldItalic.ttf"),
    "Liberation Mono": ("LiberationMono-Regular.ttf", "LiberationMono-Bold.ttf", "LiberationMono-Italic.ttf",
                        "LiberationMono-BoldItalic.ttf"),
    "FreeSans": ("FreeSans.ttf", "FreeSansBold.ttf", "FreeSansOblique.ttf", "FreeSansBoldOblique.ttf"),
    "FreeSerif": ("FreeSerif.ttf", "FreeSerifBold.ttf", "FreeSerifItalic.ttf", "FreeSerifBoldItalic.ttf"),
    "Noto Sans": ("NotoSans-Regular.ttf", "NotoSans-Bold.ttf", "NotoSans-Italic.ttf", "NotoSans-BoldItalic.ttf"),
    "Noto Serif": ("NotoSerif-Regular.ttf", "NotoSerif-Bold.ttf", "NotoSerif-Italic.ttf", "NotoSerif-BoldItalic.ttf"),
    "Lato": ("Lato-Regular.ttf", "Lato-Bold.ttf", "Lato-Italic.ttf", "Lato-BoldItalic.ttf"),
    "Open Sans": ("OpenSans-Regular.ttf", "OpenSans-Bold.ttf", "OpenSans-Italic.ttf", "OpenSans-BoldItalic.ttf"),
    "Roboto": ("Roboto-Regular.ttf", "Roboto-Bold.ttf", "Roboto-Italic.ttf", "Roboto-BoldItalic.ttf"),
}
MONOSPACE = {"DejaVu Sans Mono", "Liberation Mono"}
SERIF = {"DejaVu Serif", "DejaVu Serif Condensed", "STIX General", "Liberation Serif", "FreeSerif", "Noto Serif"}
PILLOW_FAMILY = "Pillow default (Aileron)"

# Replacements for characters a face lacks (after which NFKD + dropping combining marks is tried).
_FALLBACK = {
    "ß": "ss", "æ": "ae", "Æ": "AE", "ø": "o", "Ø": "O", "œ": "oe", "Œ": "OE", "ł": "l", "Ł": "L",
    "đ": "d", "Đ": "D", "ð": "d", "Ð": "D", "þ": "th", "Þ": "Th", "ı": "i", "ĸ": "k", "ŉ": "n", "Ŋ": "N",
    "ŋ": "n", "ħ": "h", "Ħ": "H", "€": "EUR", "£": "GBP", "¥": "JPY", "•": "-", "–": "-", "—": "-",
    "‘": "'", "’": "'", "“": '"', "”": '"', "…": "...", "№": "No", "×": "x", "°": "o", "±": "+/-",
    "«": '"', "»": '"', "©": "(c)", "®": "(R)", "¡": "!", "¿": "?", "·": ".", "§": "S", "¶": "P",
    "¼": "1/4", "½": "1/2", "¾": "3/4", "²": "2", "³": "3", "¹": "1", "µ": "u", "÷": "/", "ª": "a",
    "º": "o", "\xa0": " ",
}


def _search_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("OCRIA_SYNTHDOC_FONT_DIRS", "").split(os.pathsep) if p]
    dirs += [Path("/usr/share/fonts"), Path("/usr/local/share/fonts"), Path.home() / ".fonts",
             Path.home() / ".local" / "share" / "fonts"]
    try:
        spec = importlib.util.find_spec("matplotlib")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            dirs.append(Path(loc) / "mpl-data" / "fonts" / "ttf")
    return dirs


@lru_cache(maxsize=1)
def _font_files() -> dict[str, str]:
    """file name -> path, the first found in search order (deterministic: sorted walks)."""
    found: dict[str, str] = {}
    for d in _search_dirs():
        if not d.is_dir():
            continue
        for root, subdirs, files in os.walk(d):
            subdirs.sort()
            for f in sorted(files):
                if f.lower().endswith((".ttf", ".otf")) and f not in found:
                    found[f] = os.path.join(root, f)
    return found


def freetype_available() -> bool:
    return bool(features.check("freetype2"))


@lru_cache(maxsize=512)
def load_face(path: str | None, size: int) -> ImageFont.FreeTypeFont:
    """A face at a pixel size; path None is Pillow's bundled font. Cached per process."""
    if path is None:
        font = ImageFont.load_default(size=size)
        if not isinstance(font, ImageFont.FreeTypeFont):
            raise RuntimeError("Pillow was built without FreeType: synthdoc needs scalable fonts")
        return font
    return ImageFont.truetype(path, size=size)


@lru_cache(maxsize=64)
def face_charset(path: str | None) -> frozenset[str]:
    """The candidate characters a face has glyphs for (a missing glyph renders as .notdef)."""
    font = load_face(path, 24)
    notdef = font.getmask("\ue000")
    nd = (notdef.size, bytes(notdef))
    out = {" "}
    for ch in CANDIDATE_CHARS:
        if ch == " ":
            continue
        m = font.getmask(ch)
        if (m.size, bytes(m)) != nd and m.size[0] > 0:
            out.add(ch)
    return frozenset(out)


@dataclass(frozen=True)
class FontFamily:
    name: str
    regular: str | None  # path; None = Pillow's bundled font
    bold: str | None = None
    italic: str | None = None
    bold_italic: str | None = None
    monospace: bool = False
    charset: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @property
    def has_bold(self) -> bool:
        return self.bold is not None

    @property
    def has_italic(self) -> bool:
        return self.italic is not None

    def face(self, style: str, size: int) -> tuple[ImageFont.FreeTypeFont, int]:
        """(font, emboldening) for a style in {"r", "b", "i", "bi"}. Emboldening 0: the face as is; -d: a
        faux bold, the regular (or italic) face drawn twice, d pixels apart, where no bold face exists."""
        bold = "b" in style
        italic = "i" in style and self.has_italic
        faux = -max(1, round(size / 22))
        if bold and italic and self.bold_italic:
            return load_face(self.bold_italic, size), 0
        if italic:
            return load_face(self.italic, size), (faux if bold else 0)
        if bold:
            if self.bold:
                return load_face(self.bold, size), 0
            return load_face(self.regular, size), faux
        return load_face(self.regular, size), 0

    def clean(self, text: str) -> str:
        """`text` with every character the family cannot draw replaced (transliterated or dropped)."""
        cs = self.charset
        if all(c in cs for c in text):
            return text
        out = []
        for c in text:
            if c in cs:
                out.append(c)
                continue
            rep = _FALLBACK.get(c)
            if rep is None:
                rep = "".join(x for x in unicodedata.normalize("NFKD", c) if not unicodedata.combining(x))
            out.append("".join(x for x in rep if x in cs))
        return "".join(out)


@lru_cache(maxsize=8)
def available_families(which: str | tuple[str, ...] = "auto") -> tuple[FontFamily, ...]:
    """The families usable here: Pillow's font first, then the system families found (sorted by name).

    which: "auto" (all), "pillow" (Pillow's bundled font only) or a tuple of family names: one family
    per name, in the tuple's order, a name not found here standing for its substitute (:func:`substitute`).
    """
    if not freetype_available():
        raise RuntimeError("Pillow was built without FreeType: synthdoc needs scalable fonts")
    if isinstance(which, tuple):
        if not which:
            raise ValueError("fonts: an empty tuple names no font family")
        found = {f.name: f for f in available_families("auto")}
        return tuple(found[name] if name in found else substitute(name) for name in which)
    fams = [FontFamily(PILLOW_FAMILY, None, charset=face_charset(None))]
    if which == "pillow":
        return tuple(fams)
    if which != "auto":
        raise ValueError(f"fonts must be 'auto', 'pillow' or a tuple of family names, got {which!r}")
    files = _font_files()
    for name in sorted(KNOWN_FAMILIES):
        reg, b, i, bi = KNOWN_FAMILIES[name]
        if reg not in files:
            continue
        paths = [files.get(x) if x else None for x in (reg, b, i, bi)]
        try:
            cs = face_charset(paths[0])
            for p in paths[1:]:
                if p is not None:
                    cs = cs & face_charset(p)
        except OSError:
            continue
        fams.append(FontFamily(name, paths[0], paths[1], paths[2], paths[3], name in MONOSPACE, cs))
    return tuple(fams)


def family_kind(name: str) -> str:
    """"monospace", "serif" or "sans-serif" for a known family; ValueError for another name."""
    if name == PILLOW_FAMILY:
        return "sans-serif"
    if name not in KNOWN_FAMILIES:
        raise ValueError(f"unknown font family {name!r}; synthdoc knows {[PILLOW_FAMILY, *sorted(KNOWN_FAMILIES)]}")
    return "monospace" if name in MONOSPACE else "serif" if name in SERIF else "sans-serif"


def substitute(name: str) -> FontFamily:
    """What draws a family that is not found here: the first family found of its kind, else Pillow's font."""
    kind = family_kind(name)
    found = available_families("auto")
    return next((f for f in found[1:] if family_kind(f.name) == kind), found[0])


@lru_cache(maxsize=64)
def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def family_digest(fam: FontFamily) -> str | None:
    """A digest of the font files a family draws with (its faces in the order regular, bold, italic,
    bold-italic; None for Pillow's font, which comes with Pillow): equal digests, equal glyphs."""
    if fam.regular is None:
        return None
    faces = (fam.regular, fam.bold, fam.italic, fam.bold_italic)
    return hashlib.sha256(" ".join(_file_digest(p) if p else "-" for p in faces).encode()).hexdigest()[:16]


def family_records(which: str | tuple[str, ...] = "auto") -> list[dict[str, str | None]]:
    """[{"family": name, "sha256": family_digest}] of available_families(which), in its order."""
    return [{"family": f.name, "sha256": family_digest(f)} for f in available_families(which)]
