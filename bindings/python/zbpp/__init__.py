"""zbpp: zero-bubble pipeline parallelism, a C library with a Python binding.

What this is: the package's front door. It exposes the version of this package and of the loaded C
library, the one exception type every failing call raises (ZbError), and where the bundled `zbpp`
command-line tool is.

What this is not: torch. Importing zbpp never imports torch and never loads the C library; both
happen on first use, so schedule-only code runs without torch installed.
"""

import os

from ._lib import ZbError, lib, library_path
from ._notice import quiet
from .costs import StageCosts
from .schedule import Op, Schedule, SimResult, kinds, stack_svgs

__all__ = [
    "__version__",
    "Op",
    "Schedule",
    "SimResult",
    "StageCosts",
    "ZbError",
    "kinds",
    "library_path",
    "quiet",
    "stack_svgs",
    "tool_path",
    "version",
    "version_code",
]

# Kept equal to setup.cfg's version and to the C library's ZB_VERSION_* (tests check all three).
__version__ = "0.1.0"

ENV_TOOL = "ZBPP_TOOL"

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE_ROOT = os.path.normpath(os.path.join(_PKG_DIR, "..", "..", ".."))


def version():
    """The loaded C library's version string (zb_version()), e.g. "0.1.0"."""
    return lib().zb_version().decode("utf-8", errors="replace")


def version_code():
    """The loaded C library's version code, major*10000 + minor*100 + patch (zb_version_code())."""
    return int(lib().zb_version_code())


def tool_path():
    """The path of the `zbpp` command-line tool.

    Looks at $ZBPP_TOOL, then the copy bundled in this package (bin/zbpp), then build/zbpp at the
    top of a source checkout. Raises FileNotFoundError naming the paths it tried.
    """
    env = os.environ.get(ENV_TOOL)
    if env:
        candidates = [os.path.abspath(env)]
    else:
        candidates = [
            os.path.join(_PKG_DIR, "bin", "zbpp"),
            os.path.join(_SOURCE_ROOT, "build", "zbpp"),
        ]
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        "zbpp: the zbpp tool was not found (or is not executable); tried "
        + ", ".join(candidates)
        + ". Build it with `cmake -S . -B build && cmake --build build`, install the package with "
        f"`pip install .`, or point {ENV_TOOL} at it."
    )


# The torch integration, imported on first use so that `import zbpp` and schedule-only code never
# import torch. Each name maps to the module that defines it.
_TORCH_EXPORTS = {
    "split_linear": "split",
    "split_report": "split",
    "SplitLinear": "split",
    "PipelineStage": "pipelining",
    "PipelineSchedule": "pipelining",
    "ScheduleGPipe": "pipelining",
    "Schedule1F1B": "pipelining",
    "ScheduleInterleaved1F1B": "pipelining",
    "ScheduleZBH1": "pipelining",
    "ScheduleZBH2": "pipelining",
    "ScheduleZBVZeroBubble": "pipelining",
    "ScheduleZBV": "pipelining",
    "ScheduleVHalf": "pipelining",
    "ScheduleVMin": "pipelining",
    "ScheduleZBAuto": "pipelining",
    "ScheduleGroupInterleaved1F1B": "pipelining",
    "ScheduleInterleavedZeroBubble": "pipelining",
    "ScheduleFromCSV": "pipelining",
    "ScheduleLoopedBFS": "pipelining",
    "ScheduleDualPipeV": "pipelining",
    "PipelineScheduleSingle": "pipelining",
    "PipelineScheduleMulti": "pipelining",
    "PlanInfo": "pipelining",
    "get_schedule_class": "pipelining",
    "PostValidatedOptimizer": "optim",
    "VocabParallel": "vocab",
}
__all__ += list(_TORCH_EXPORTS)

# Library queries that need neither torch nor a GPU (the ctypes layer only).
_RUNTIME_EXPORTS = ("cuda_built", "cuda_device_count")
__all__ += list(_RUNTIME_EXPORTS)


def __getattr__(name):
    import importlib

    if name in _RUNTIME_EXPORTS:
        value = getattr(importlib.import_module(".runtime", __name__), name)
        globals()[name] = value
        return value
    module = _TORCH_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zbpp' has no attribute {name!r}")

    import torch  # noqa: F401 - first, so the library binds to torch's CUDA libraries (DESIGN.md 5)

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
