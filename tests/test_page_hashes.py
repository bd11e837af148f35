"""The pages of fixed seeds, pinned: a change to the page generator (ocria_rt.synthdoc), to its text
source (faker's pinned version) or to the renderer (Pillow's FreeType, JPEG, numpy's noise) that changes
any held-out page's Markdown or pixels fails here, because it changes the pages `ocria-rt eval` scores
and the figures measured on them.

A page depends on the font families it may draw from, and those are not shipped: only Pillow's own
font comes with a dependency. Cases drawn with it run everywhere. The "mini-trained" cases draw as
`ocria-rt eval` does for ocria-mini: from its training machine's families (training.json), which on a
Debian machine with fonts-dejavu 2.37-6 and no STIX (the CI image) are Debian's DejaVu files, STIX
General drawn with DejaVu Serif; they are pinned by those files' digests and skipped, naming the family,
where the families drawn differ.

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
TRAINED = (PILLOW, "DejaVu Sans", "DejaVu Sans Mono", "DejaVu Serif", "STIX General")
# family_records(TRAINED) where the hashes were recorded: the family drawing each slot and its files' digest
DRAWN = [{"family": PILLOW, "sha256": None}, {"family": "DejaVu Sans", "sha256": "11046e47cc1adc19"},
         {"family": "DejaVu Sans Mono", "sha256": "eba7b07401965daf"},
         {"family": "DejaVu Serif", "sha256": "5b502722f391466f"}, {"family": "DejaVu Serif", "sha256": "5b502722f391466f"}]

CASES: dict[str, tuple[int, PageConfig]] = {
    **{f"mini-pillow-{i}": (page_seed("heldout", i), synthdoc.with_overrides(MINI, fonts="pillow")) for i in range(3)},
    "mini-words": (page_seed("heldout", 0), synthdoc.with_overrides(MINI, fonts="pillow", use_faker=False)),
    "invoice-pillow": (page_seed("heldout", 5), PageConfig(layout="invoice", long_side=(640, 640), fonts="pillow")),
    # held-out pages 0, 1, 4, 5 fall to STIX General (its substitute here), DejaVu Sans, Serif, Sans Mono
    **{f"mini-trained-{i}": (page_seed("heldout", i), synthdoc.with_overrides(MINI, fonts=TRAINED)) for i in (0, 1, 4, 5)},
}

# case: (sha256 of the Markdown, sha256 of the pixels), 16 hex digits each; recorded with faker 40.63.0,
# Pillow 13.0.0 (FreeType 2.14.3, libjpeg-turbo 3.2.0), numpy 2.4.6
EXPECTED = {
    "invoice-pillow": ('7e436a582401cdaf', 'fd4062819cc292b7'),
    "mini-pillow-0": ('5d6e20a32946ea39', 'd89dc198dd66b2e7'),
    "mini-pillow-1": ('b1b59fadd870a9db', '562336d28518a386'),
    "mini-pillow-2": ('35586dd13bdf664e', '58a82c0ef12f264c'),
    "mini-trained-0": ('b8b2f328bc39a323', 'a51f7ec1c7ecce6e'),
    "mini-trained-1": ('e4cc0cef6e218815', '097503a77fd1f0f0'),
    "mini-trained-4": ('0d2a46c60d0b0df7', '08e8bb78e0a0861e'),
    "mini-trained-5": ('eabcaef4d9bc7aff', '906c98f49d2ed78d'),
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
    here = synthdoc.family_records(config.fonts)
    for name, want, got in zip(config.fonts, DRAWN, here):
        if got != want:
            pytest.skip(f"{name}: drawn here with {got['family']} (files {got['sha256']}), recorded with "
                        f"{want['family']} (files {want['sha256']}, Debian fonts-dejavu 2.37-6): the page's pixels "
                        f"and line breaks depend on these font files, which are not shipped")


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
