"""Checking the arguments of zbpp.schedule's constructors, with messages in that API's terms.

What this is: the small helpers Schedule.generate, from_csv and from_ops (schedule.py) use to turn
Python arguments into the numbers a zb_schedule_spec_t holds: numbers, indices and counts that
refuse bools and say which argument was wrong, the `times` argument (scalars, a tuple or per-stage
lists) and the `mem_limit` argument (a number or a multiple of p such as "2p").
What this is not: the spec itself or any call into the C library (schedule.py builds and passes
the spec, and the library checks every value again). Only the standard library is used here.
"""

import math
import numbers
import operator


def _is_number(x):
    # bool is an int to Python, but True as a time or a size is a mistake, not a 1.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _number(x, what):
    if not _is_number(x):
        raise TypeError(f"{what} must be a number, got {x!r}")
    return float(x)


def _index(x, what):
    """An integer argument (a rank, a stage); the library checks its range and names it."""
    if isinstance(x, bool):
        raise TypeError(f"{what} must be an integer, got {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {x!r}") from None


def _count(x, what, minimum=1):
    """An integer argument such as p or m, >= minimum."""
    value = _index(x, what)
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


_TIME_KEYS = ("f", "b", "w", "bw", "offload", "reload")


def _parse_times(times, stages, where):
    """The spec's cost fields from the `times` argument.

    Returns ({'f': scalar, ...}, {'f': [S floats] or None, ...}). `stages` is S, the number of
    per-stage values a list must have; `where` says how S was worked out, for the message.
    """
    # bw <= 0 means b + w (zbpp.h); offload and reload: the copy times of PipeOffload's ops
    scalars = {"f": 1.0, "b": 1.0, "w": 1.0, "bw": 0.0, "offload": 0.0, "reload": 0.0}
    arrays = dict.fromkeys(_TIME_KEYS)
    if times is None:
        return scalars, arrays
    if isinstance(times, (tuple, list)):
        if len(times) not in (3, 4) or not all(_is_number(t) for t in times):
            raise ValueError(
                f"times as a tuple must be (f, b, w) or (f, b, w, bw) numbers (per-rank times), got {times!r}; "
                "use a dict such as {'f': [...], 'b': ...} for per-stage times")
        for key, value in zip(_TIME_KEYS[:4], times):
            scalars[key] = float(value)
        return scalars, arrays
    if not isinstance(times, dict):
        raise TypeError(
            f"times must be None, a dict with keys among 'f', 'b', 'w', 'bw', 'offload', 'reload', or a tuple "
            f"(f, b, w[, bw]); "
            f"got {type(times).__name__}")
    for raw_key, value in times.items():
        key = raw_key.lower() if isinstance(raw_key, str) else raw_key
        if key not in _TIME_KEYS:
            raise ValueError(f"times has an unknown key {raw_key!r}; allowed keys: 'f', 'b', 'w', 'bw', 'offload', "
                             "'reload' (any case)")
        if _is_number(value):
            scalars[key] = float(value)
            continue
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise TypeError(
                f"times[{raw_key!r}] must be a number (the time of one microbatch through all of a rank's "
                f"layers) or a sequence of {stages} per-stage times, got {value!r}")
        values = list(value)
        if len(values) != stages:
            raise ValueError(
                f"times[{raw_key!r}] has {len(values)} values; per-stage times need one per stage, "
                f"S = {stages} ({where})")
        for i, t in enumerate(values):
            if not _is_number(t):
                raise TypeError(f"times[{raw_key!r}][{i}] must be a number, got {t!r}")
        arrays[key] = [float(t) for t in values]
    return scalars, arrays


def _mem_limit(mem_limit, p):
    """A memory limit in microbatches (0.0 for none) from None, a number or "<x>p"."""
    if mem_limit is None:
        return 0.0
    if isinstance(mem_limit, str):
        # "2p", "1.5 p", "2*p", "p" (a multiple of p, as the paper writes limits), or "6".
        text = mem_limit.strip().lower().replace("*", "")
        multiple = text.endswith("p")
        number = text[:-1].strip() if multiple else text
        try:
            value = float(number) if number else (1.0 if multiple else None)
        except ValueError:
            value = None
        if value is None:
            raise ValueError(
                f"mem_limit {mem_limit!r} is not understood; give a number of microbatches, or a multiple "
                "of p such as 'p', '2p' or '1.5p'")
        if multiple:
            value *= p
    else:
        value = _number(mem_limit, "mem_limit")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"mem_limit must be a finite number > 0 (None for no limit), got {mem_limit!r}")
    return value
