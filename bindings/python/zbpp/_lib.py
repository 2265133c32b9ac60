"""The ctypes layer: finds and loads libzbpp.so, and turns non-OK statuses into ZbError.

What this is: the only module that touches ctypes. The library is loaded on first use (`lib()`),
not at import, so `import zbpp` always works and a missing library is reported by the call that
needed it, with the paths that were tried and how to build it.

What this is not: torch-aware. Schedule-only use must not need torch, so this module never imports
it. The torch integration modules import torch *before* their first call into `lib()`, so that the
library binds to the same cudart, cuBLASLt and NCCL copies that torch loaded (DESIGN.md section 5).

Search order for the library:
  1. $ZBPP_LIBRARY, when set (and nothing else: a wrong path is an error, not a fallback);
  2. libzbpp.so inside this package (a wheel or an installed package);
  3. build/libzbpp.so at the top of a source checkout (bindings/python/zbpp/../../../build).
"""

import ctypes
import os
import threading

__all__ = ["ZbError", "call", "check", "function", "lib", "library_path", "status_name"]

ENV_LIBRARY = "ZBPP_LIBRARY"
LIB_NAME = "libzbpp.so"
ZB_OK = 0

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_SOURCE_ROOT = os.path.normpath(os.path.join(_PKG_DIR, "..", "..", ".."))

_HOW_TO_BUILD = (
    "Build it from a source checkout with `cmake -S . -B build && cmake --build build` "
    "(then this package finds build/libzbpp.so), install the package with `pip install .`, "
    f"or point {ENV_LIBRARY} at a libzbpp.so."
)

_lock = threading.Lock()
_lib = None
_lib_path = None


def _decode(raw):
    return raw.decode("utf-8", errors="replace") if raw is not None else ""


def status_name(code):
    """The C library's text for a status code (zb_status_string), or 'status N' if not loaded."""
    if _lib is not None:
        return _decode(_lib.zb_status_string(int(code)))
    return f"status {int(code)}"


class ZbError(Exception):
    """A zbpp call failed. `code` is the zb_status_t value, `message` zb_last_error()'s text."""

    def __init__(self, code, message="", name=None):
        self.code = int(code)
        self.message = message
        self.name = name if name is not None else status_name(self.code)
        super().__init__(self.code, self.message, self.name)

    def __str__(self):
        text = f"{self.name} (zb status {self.code})"
        return f"{text}: {self.message}" if self.message else text


def check(status):
    """Raises ZbError for a non-OK zb_status_t, with the message zb_last_error() left."""
    status = int(status)
    if status != ZB_OK:
        library = lib()
        raise ZbError(status, _decode(library.zb_last_error()), _decode(library.zb_status_string(status)))


def _candidates():
    """(path, why) pairs in search order; with ZBPP_LIBRARY set it is the only candidate."""
    env = os.environ.get(ENV_LIBRARY)
    if env:
        return [(os.path.abspath(env), f"${ENV_LIBRARY}")]
    return [
        (os.path.join(_PKG_DIR, LIB_NAME), "the installed package"),
        (os.path.join(_SOURCE_ROOT, "build", LIB_NAME), "the source checkout's build/"),
    ]


def _declare(library, path):
    """Sets argtypes/restype for the calls this layer makes; a missing symbol is a stale build."""
    c = ctypes
    signatures = {
        "zb_status_string": ([c.c_int], c.c_char_p),
        "zb_last_error": ([], c.c_char_p),
        "zb_version": ([], c.c_char_p),
        "zb_version_code": ([], c.c_int),
        "zb_free": ([c.c_void_p], None),
    }
    for name, (argtypes, restype) in signatures.items():
        try:
            fn = getattr(library, name)
        except AttributeError:
            raise OSError(f"{path} does not export {name}; is it an old or foreign build? {_HOW_TO_BUILD}") from None
        fn.argtypes = argtypes
        fn.restype = restype


def lib():
    """The loaded library (a ctypes.CDLL), loading it on the first call. Raises OSError if absent."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path, why in _candidates():
            if not os.path.isfile(path):
                tried.append(f"{path} ({why}: not found)")
                continue
            try:
                library = ctypes.CDLL(path)
            except OSError as exc:
                # Found but unloadable (wrong architecture, missing dependency): say so, don't fall
                # back silently to another copy.
                raise OSError(f"zbpp: cannot load {path} ({why}): {exc}") from exc
            _declare(library, path)
            _lib_path = path
            _lib = library
            return _lib
        raise OSError("zbpp: the C library libzbpp.so was not found. Tried: " + "; ".join(tried) + ". " + _HOW_TO_BUILD)


def library_path():
    """The path of the library `lib()` loaded (loading it if needed)."""
    lib()
    return _lib_path


_functions = {}


def function(name, argtypes, restype=ctypes.c_int):
    """The C function `name` with its ctypes signature declared (cached).

    Each wrapper module declares the calls it makes where it makes them, so the signatures live
    next to the code that relies on them. restype defaults to c_int: every zb_ call returns a
    zb_status_t. A missing symbol means the library is older than this package: say so.
    """
    fn = _functions.get(name)
    if fn is not None:
        return fn
    library = lib()
    try:
        fn = getattr(library, name)
    except AttributeError:
        raise OSError(f"{_lib_path} does not export {name}; it is older than this package. {_HOW_TO_BUILD}") from None
    fn.argtypes = list(argtypes)
    fn.restype = restype
    _functions[name] = fn
    return fn


def call(name, argtypes, *args):
    """Declares (once) and calls a zb_ function returning zb_status_t; raises ZbError on failure."""
    check(function(name, argtypes)(*args))
