"""Shared pytest set-up for zbpp's Python tests.

- The `gpu` marker: tests that need a CUDA device. They are skipped, with the reason, when torch is
  not installed or torch.cuda.is_available() is false; torch is imported only if such a test was
  collected, so CPU-only runs stay fast and work without torch.
- Which build is tested: $ZBPP_BUILD_DIR (default: <repo>/build), the CMake build directory holding
  libzbpp.so and the zbpp tool. In-process imports of zbpp use the source package
  (bindings/python) with that build's library and tool, unless ZBPP_LIBRARY / ZBPP_TOOL are set.
"""

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("ZBPP_BUILD_DIR") or REPO_ROOT / "build").resolve()
PYTHON_SRC = REPO_ROOT / "bindings" / "python"

if str(PYTHON_SRC) not in sys.path:
    sys.path.insert(0, str(PYTHON_SRC))
os.environ.setdefault("ZBPP_LIBRARY", str(BUILD_DIR / "libzbpp.so"))
os.environ.setdefault("ZBPP_TOOL", str(BUILD_DIR / "zbpp"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and torch with CUDA; skipped without")


def _cuda_unavailable_reason():
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed ({exc})"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is false"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _cuda_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def repo_root():
    return REPO_ROOT


@pytest.fixture(scope="session")
def build_dir():
    """The CMake build under test; fails (not skips) if it lacks the library or the tool."""
    missing = [name for name in ("libzbpp.so", "zbpp") if not (BUILD_DIR / name).is_file()]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found in {BUILD_DIR}: build first "
            f"(cmake -S . -B build && cmake --build build) or set ZBPP_BUILD_DIR",
            pytrace=False,
        )
    return BUILD_DIR


@pytest.fixture(scope="session", autouse=True)
def _remove_rendezvous_files():
    """Multi-process tests meet through files (pipeline_worker.store_url); a rank that a test kills
    on purpose leaves its file behind, so this session's files go when it ends."""
    yield
    import glob
    import tempfile

    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"zbpp-store-{os.getpid()}-*")):
        try:
            os.remove(path)
        except OSError:
            pass
