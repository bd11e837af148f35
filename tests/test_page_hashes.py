"""The pages of fixed seeds, pinned: a change to the page generator (ocria_rt.synthdoc), to its text
source (faker's pinned version) or to the renderer (Pillow's FreeType, JPEG, numpy's noise) that changes
any held-out page's Markdown or pixels fails here, because it changes the pages `ocria-rt eval` scores
and the figures measured on them.

A page depends on the font families it may draw from, and those are not shipped: only Pillow's own
font comes with a dependency. Cases drawn with it run everywhere. The DejaVu case draws with the
families `ocria-rt eval` uses for ocria-mini on a Debian machine with fonts-dejavu (2.37-6, the CI
image), pinned by their files' digests; it is skipped, naming the family, where those files are absent.

After an intended change, `python tests/test_page_hashes.py` prints the table to paste below.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys

import numpy as np
import pytest
from PIL import features

from ocria_rt import synthdoc
from ocria_rt.synthdoc import PageConfig, generate_page, page_seed

PILLOW = synthdoc.fonts.PILLOW_FAMILY
# ocria-mini's training distribution (its training.json), spelled out so a new model does not move it
MINI = PageConfig(long_side=(320, 448), body_px=(64, 88), max_chars=150)
DEJAVU = (PILLOW, "DejaVu Sans", "DejaVu Sans Mono", "DejaVu Serif")
DEJAVU_DIGESTS = {"DejaVu Sans": "11046e47cc1adc19", "DejaVu Sans Mono": "eba7b07401965daf",
                  "DejaVu Serif": "5b502722f391466f"}

CASES: dict[str, tuple[int, PageConfig]] = {
    **{f"mini-pillow-{i}": (page_seed("heldout", i), synthdoc.with_overrides(MINI, fonts="pillow")) for i in range(3)},
    "mini-words": (page_seed("heldout", 0), synthdoc.with_overrides(MINI, fonts="pillow", use_faker=False)),
    "invoice-pillow": (page_seed("heldout", 5), PageConfig(layout="invoice", long_side=(640, 640), fonts="pillow")),
    **{f"mini-dejavu-{i}": (page_seed("heldout", i), synthdoc.with_overrides(MINI, fonts=DEJAVU)) for i in range(3)},
}

# case: (sha256 of the Markdown, sha256 of the pixels), 16 hex digits each; recorded with faker 40.63.0,
# Pillow 13.0.0 (FreeType 2.14.3, libjpeg-turbo 3.2.0), numpy 2.4.6
EXPECTED = {
    "invoice-pillow": ('7e436a582401cdaf', 'fd4062819cc292b7'),
    "mini-dejavu-0": ('b4e71d30f06df9f7', 'd0cc0401be12a765'),
    "mini-dejavu-1": ('c29cd627ccfe4a44', 'b282f515c0b3e7f4'),
    "mini-dejavu-2": ('c46cc4a95104ec8a', '84c2b5c5b2687f19'),
    "mini-pillow-0": ('5d6e20a32946ea39', 'd89dc198dd66b2e7'),
    "mini-pillow-1": ('b1b59fadd870a9db', '562336d28518a386'),
    "mini-pillow-2": ('35586dd13bdf664e', '58a82c0ef12f264c'),
    "mini-words": ('fd95f18b977cfd90', '7cc08dc9c8c961a1'),
}


def digests(image, markdown: str) -> tuple[str, str]:
    pixels = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))
    shape = "x".join(str(n) for n in pixels.shape).encode()
    return (hashlib.sha256(markdown.encode()).hexdigest()[:16],
            hashlib.sha256(shape + b"\n" + pixels.tobytes()).hexdigest()[:16])


def environment() -> str:
    return (f"faker {importlib.metadata.version('faker')}, Pillow {importlib.metadata.version('Pillow')} "
            f"(FreeType {features.version('freetype2')}, libjpeg-turbo {features.version('libjpeg_turbo')}), "
            f"numpy {np.__version__}")


def _skip_without_recorded_fonts(config: PageConfig) -> None:
    if not isinstance(config.fonts, tuple):
        return
    here = {f["family"]: f["sha256"] for f in synthdoc.family_records("auto")}
    for family in config.fonts:
        if family != PILLOW and here.get(family) != DEJAVU_DIGESTS[family]:
            found = "absent" if family not in here else f"other files (digest {here[family]})"
            pytest.skip(f"{family}: the font files these hashes were recorded with (digest "
                        f"{DEJAVU_DIGESTS[family]}, Debian fonts-dejavu 2.37-6) are {found} here; the page's "
                        f"pixels and line breaks depend on them and they are not shipped")


@pytest.mark.parametrize("case", sorted(CASES))
def test_page_of_a_fixed_seed_is_unchanged(case):
    seed, config = CASES[case]
    _skip_without_recorded_fonts(config)
    image, markdown, _ = generate_page(seed, config)
    md_hash, px_hash = digests(image, markdown)
    want_md, want_px = EXPECTED[case]
    assert md_hash == want_md, (f"the Markdown of {case} (seed {seed}) changed; here: {environment()}. An intended "
                                f"change: re-record with `python tests/test_page_hashes.py` and re-measure "
                                f"`ocria-rt eval`. Markdown now:\n{markdown}")
    assert px_hash == want_px, (f"the pixels of {case} (seed {seed}) changed, its Markdown did not; here: "
                                f"{environment()}. An intended change: re-record with "
                                f"`python tests/test_page_hashes.py` and re-measure `ocria-rt eval`")


if __name__ == "__main__":
    print(f"# recorded with {environment()}; fonts: {synthdoc.family_records('auto')}", file=sys.stderr)
    for name in sorted(CASES):
        seed, config = CASES[name]
        image, markdown, _ = generate_page(seed, config)
        print(f'    "{name}": {digests(image, markdown)!r},')
