from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/support.py, tests/reference_ops.py


def _why_no_cuda() -> str | None:
    import ocria_rt

    info = ocria_rt.build_info()
    if not info["cuda"]:
        return "ocria_rt was built without CUDA support"
    if not info["cuda_devices"]:
        return "no CUDA device is visible"
    return None


def pytest_collection_modifyitems(config, items):
    """Everything under tests/gpu/ is marked `gpu` and skipped, with the reason, where CUDA is unusable."""
    reason = None
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            reason = reason or _why_no_cuda() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
