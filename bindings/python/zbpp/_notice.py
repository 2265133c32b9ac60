"""One line on standard error the first time zbpp changes something a user did not ask it to
change in so many words (a replan of their schedule), at default verbosity and without a warning.

What this is: notice(key, text), which prints "zbpp: ..." once per key and process, unless notices
are off: zbpp.quiet() (or quiet(False) to turn them back on), or ZBPP_QUIET=1 in the environment.
Everything a notice says is also logged at INFO on the "zbpp" logger, every time, by the caller.

Why not logging: Python's logging shows only warnings by default, and a replan is not a warning;
a library must not configure the root logger either. Why once: the same change repeats every few
steps under plans from measured costs; the first says what happens and how to turn it off.
"""

import os
import sys
import threading

_lock = threading.Lock()
_said = set()
_quiet = None  # None: from ZBPP_QUIET


def quiet(on=True):
    """Turns zbpp's one-line notices on standard error off (on=True) or on again (on=False)."""
    global _quiet
    _quiet = bool(on)


def _is_quiet():
    if _quiet is not None:
        return _quiet
    value = os.environ.get("ZBPP_QUIET", "")
    return value not in ("", "0")


def notice(key, text):
    """Prints text (prefixed "zbpp: " if it is not) once per key, unless notices are off."""
    if _is_quiet():
        return
    with _lock:
        if key in _said:
            return
        _said.add(key)
    if not text.startswith("zbpp"):
        text = "zbpp: " + text
    print(text, file=sys.stderr, flush=True)
