"""Schedule's exports: the text, CSV, JSON, Chrome-trace and SVG forms, files, and stacked SVGs.

What this is: _ScheduleExports, the mixin that gives zbpp.schedule.Schedule its export, to_text,
to_csv, to_json, to_chrome, to_svg and save methods (each asks the C library's zb_schedule_export
through the schedule's `handle`), and stack_svgs, which puts several such SVG pictures one above
the other. Both are used through zbpp.schedule (Schedule, stack_svgs), which imports them.
What this is not: a writer of any format; every export's text comes from the C library, so the
zbpp tool and this binding write the same bytes. This module never imports schedule.py.
"""

import ctypes
import os
import re
from xml.sax.saxutils import escape

from . import _lib
from ._files import write_text

# File name endings save() understands; longer endings first, so "x.trace.json" is a Chrome trace.
_EXTENSION_FORMATS = (
    ("trace.json", "chrome"),
    (".trace", "chrome"),
    (".svg", "svg"),
    (".csv", "csv"),
    (".json", "json"),
    (".txt", "text"),
)


class _ScheduleExports:
    """Schedule's export methods; the class using it provides `handle` (a zb_schedule_t*)."""

    def export(self, fmt):
        """The schedule as text in a format: 'text', 'csv', 'json', 'chrome', 'svg' or 'csv-comms'
        (torch's compute_comms form: the CSV with the transfers, receives placed by the
        schedule's times, which torch's _PipelineScheduleRuntime._load_csv(format="compute_comms")
        runs). Formats with times simulate first if that has not been done."""
        if not isinstance(fmt, str):
            raise TypeError(f"fmt must be a format name ('text', 'csv', 'json', 'chrome', 'svg', 'csv-comms'), "
                            f"got {fmt!r}")
        fmt_value = ctypes.c_int(0)
        _lib.call("zb_format_from_name", [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)],
                  fmt.lower().encode("utf-8"), ctypes.byref(fmt_value))
        # The buffer is the caller's to free with zb_free; c_void_p keeps ctypes from converting
        # (and losing) the pointer the way c_char_p would.
        text = ctypes.c_void_p()
        length = ctypes.c_size_t(0)
        _lib.call("zb_schedule_export",
                  [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)],
                  self.handle, fmt_value.value, ctypes.byref(text), ctypes.byref(length))
        try:
            return ctypes.string_at(text.value, length.value).decode("utf-8", errors="replace")
        finally:
            _lib.function("zb_free", [ctypes.c_void_p], None)(text)

    def to_text(self):
        return self.export("text")

    def to_csv(self, comms=False):
        """torch's CSV: compute_only, or with comms=True the compute_comms form (see export)."""
        return self.export("csv-comms" if comms else "csv")

    def to_json(self):
        return self.export("json")

    def to_chrome(self):
        return self.export("chrome")

    def to_svg(self):
        return self.export("svg")

    def set_display(self, name=None, time_unit=None, time_span=0.0):
        """What the exports call this schedule and its time (zb_schedule_set_display): name, the
        title of the svg, chrome and text exports (None: the kind's name); time_unit, e.g. "ms"
        (None: the costs' unit, unnamed); time_span > 0 draws the svg's time axis over that much
        time at a fixed width, so pictures given the same span share one scale (stack_svgs does
        this for the schedules it is given). Returns self."""
        span = float(time_span)
        for what, text in (("name", name), ("time_unit", time_unit)):
            if text is not None and not isinstance(text, str):
                raise TypeError(f"set_display: {what} must be a string or None, got {type(text).__name__}")
        _lib.call("zb_schedule_set_display", [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_double],
                  self.handle, name.encode() if name else None, time_unit.encode() if time_unit else None, span)
        self._display = (name, time_unit, span)
        return self

    def display(self):
        """(name, time_unit, time_span) as set_display last set them (None, None, 0.0 if never)."""
        return getattr(self, "_display", (None, None, 0.0))

    def save(self, path, fmt=None):
        """Writes the schedule to a file. fmt None picks it from the name: .svg, .csv, .json,
        .txt (text), and a name ending in 'trace.json' or '.trace' for a Chrome trace."""
        if fmt is None:
            name = os.fspath(path)
            name = name.decode("utf-8", errors="replace") if isinstance(name, bytes) else name
            lowered = name.lower()
            fmt = next((f for ending, f in _EXTENSION_FORMATS if lowered.endswith(ending)), None)
            if fmt is None:
                endings = ", ".join(f"'{ending}' ({f})" for ending, f in _EXTENSION_FORMATS)
                raise ValueError(f"save: cannot tell the format of {name!r} from its name; use one of {endings}, "
                                 "or pass fmt= ('text', 'csv', 'json', 'chrome', 'svg')")
        # Whole or not at all: a failed write leaves an existing file as it was (_files.py).
        write_text(path, self.export(fmt))


def stack_svgs(parts):
    """One SVG picture of several schedule pictures one above the other, each under its caption:
    `parts` is a list of (caption, picture), each picture a Schedule or the svg text of one
    (Schedule.to_svg()). Used to draw a run's measured timeline under the plan it ran
    (examples/train_gpt.py), where a person compares them at a glance. Schedules are drawn on one
    time scale: each over the longest makespan of them (set_display's time_span), so their times
    must be in one unit (a plan from measured costs and a measured step: milliseconds). SVG texts
    keep the scale they were drawn at."""
    schedules = [pic for _, pic in parts if not isinstance(pic, str)]
    span = max((sc.simulate().makespan or 0.0 for sc in schedules), default=0.0)
    texts = []
    for caption, pic in parts:
        if not isinstance(pic, str):
            sched = pic
            name, unit, own = sched.display()
            sched.set_display(name, unit, span)
            try:
                pic = sched.to_svg()
            finally:
                sched.set_display(name, unit, own)
        texts.append((caption, pic))
    pieces, y, width = [], 0, 0
    for caption, svg in texts:
        head = re.match(r"\s*<svg\b[^>]*>", svg)
        w = re.search(r'\bwidth="([0-9.]+)"', head.group(0)) if head else None
        h = re.search(r'\bheight="([0-9.]+)"', head.group(0)) if head else None
        if not (head and w and h):
            raise ValueError("stack_svgs: each part must be an <svg> element with width and height, "
                             "as Schedule.to_svg() writes")
        w, h = float(w.group(1)), float(h.group(1))
        pieces.append(f'<text x="10" y="{y + 20:g}" font-size="16" font-weight="bold">{escape(caption)}</text>')
        inner = head.group(0).replace("<svg", f'<svg x="0" y="{y + 28:g}"', 1) + svg[head.end():]
        pieces.append(inner.strip())
        y += 28 + h + 12
        width = max(width, w)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:g}" height="{y:g}" '
            f'viewBox="0 0 {width:g} {y:g}" font-family="Helvetica, Arial, sans-serif">\n'
            + "\n".join(pieces) + "\n</svg>\n")
