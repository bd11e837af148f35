"""The compiled CUDA kernels keep the programmatic-dependent-launch rule (csrc/ops/cuda/backend.cuh):
no kernel that waits for its predecessor (griddepcontrol.wait, SASS ACQBULK) loads memory as invariant
(LDG ... .CONSTANT) before that wait.

The compiler may turn loads through const __restrict__ pointers into invariant loads and move them
above the wait, where they read what the previous kernel has not yet written: a race the CUDA source
does not show (it made speculative_advance_kernel read the previous step's acceptance count). Weights
read before the wait on purpose come through plain loads (ParamView, cp.async) and pass.

Needs a CUDA build of the library and cuobjdump (PATH, $CUDA_HOME/bin or /usr/local/cuda/bin, or
OCRIA_RT_CUOBJDUMP); skipped otherwise. No GPU is needed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import ocria_rt

INVARIANT_LOAD = re.compile(r"\bLDG\S*\.CONSTANT\b")


def cuobjdump() -> str | None:
    candidates = [os.environ.get("OCRIA_RT_CUOBJDUMP"), shutil.which("cuobjdump")]
    candidates += [str(Path(d) / "bin" / "cuobjdump") for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if d]
    return next((c for c in candidates if c and Path(c).is_file()), None)


def kernels_loading_before_wait(sass: str) -> dict[str, list[str]]:
    """Kernel (mangled name) -> its invariant loads before its first ACQBULK, for kernels that wait."""
    found: dict[str, list[str]] = {}
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name, _, body = block.partition("\n")
        before, wait, _ = body.partition("ACQBULK")
        if wait:
            loads = [line.strip() for line in before.splitlines() if INVARIANT_LOAD.search(line)]
            if loads:
                found[name.strip()] = loads
    return found


def test_the_parser_finds_a_hoisted_load():
    sass = ("\n\tFunction : k_bad\n /*0050*/ PREEXIT ;\n /*0060*/ LDG.E.CONSTANT R0, desc[UR6][R2.64] ;\n"
            " /*0080*/ ACQBULK ;\n\tFunction : k_good\n /*0010*/ LDG.E R1, desc[UR4][R2.64] ;\n /*0020*/ ACQBULK ;\n"
            " /*0030*/ LDG.E.CONSTANT R3, desc[UR4][R4.64] ;\n\tFunction : k_no_wait\n"
            " /*0010*/ LDG.E.CONSTANT R1, desc[UR4][R2.64] ;\n")
    assert kernels_loading_before_wait(sass) == {"k_bad": ["/*0060*/ LDG.E.CONSTANT R0, desc[UR6][R2.64] ;"]}


def test_no_invariant_load_before_the_pdl_wait():
    tool, info = cuobjdump(), ocria_rt.build_info()
    if not info["cuda"] or tool is None:
        pytest.skip("needs the CUDA build of the library and cuobjdump")
    libraries = sorted(Path(info["library_dir"]).glob("libocria_rt.so*"))
    assert libraries, "no libocria_rt.so in the package's library directory"
    sass = subprocess.run([tool, "-sass", str(libraries[0])], capture_output=True, text=True, check=True).stdout
    assert "ACQBULK" in sass, "no kernel waits on its predecessor: is this the sm_90 build?"
    bad = kernels_loading_before_wait(sass)
    if not bad:
        return
    names = list(bad)
    if shutil.which("c++filt"):  # readable kernel names in the message
        names = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    pytest.fail("invariant loads before griddepcontrol.wait in:\n" +
                "\n".join(f"{n[:160]}: {loads[0]}" for n, loads in zip(names, bad.values())))
