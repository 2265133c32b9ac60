"""bench_synthetic_report.py - bench_synthetic.py's tables and timeline picture.

What this is: the markdown tables bench_synthetic.py prints from its cells' figures (the step
table with plan and replay efficiencies, the replanning table, the stability table of repeated
launches) and the SVG of one configuration's measured timeline. Plain functions of the JSON-able
figures, so they can be rerun on a saved --json file.
What this is not: where anything is measured (bench_synthetic.py, bench_synthetic_timing.py).
"""

import statistics

BASELINE = ("torch", "Schedule1F1B")
STABILITY_TARGET = 0.03  # issue 25: repeated runs within 3% of each other after the replan


def label(impl, name):
    return f"{impl} {name}"


def paired(cfg, other):
    """Median over the repetitions of other's mean step / cfg's mean step in the same repetition."""
    return statistics.median(o / c for c, o in zip(cfg["rep_ms"], other["rep_ms"]))


def _ms(x):
    return "-" if x is None else f"{x:.1f}"


def table(cells):
    """The step table; plans not simulated from pipeline_order are marked and explained below."""
    lines = ["| p | m | costs | configuration | step (ms, median) | reps min-max | plan (ms) | eff | replay (ms) "
             "| runtime eff | vs torch 1F1B | vs torch same class | W/op (ms) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = {}
    for cell in cells:
        by = {c["label"]: c for c in cell["configs"] if "median_ms" in c}
        base = by.get(label(*BASELINE))
        for c in cell["configs"]:
            head = f"| {cell['p']} | {cell['m']} | {cell['cost']} | {c['label']} |"
            if "skipped" in c:
                lines.append(f"{head} not run: {c['skipped']} | | | | | | | | |")
                continue
            mark = ""
            if c["plan_source"] != "pipeline_order":
                mark = "*" * (list(notes).index(c["plan_source"]) + 1 if c["plan_source"] in notes else len(notes) + 1)
                notes.setdefault(c["plan_source"], (mark, c["label"]))
            vs = f"{paired(c, base):.2f}x" if base else "-"
            twin = by.get(label("torch", c["name"])) if c["impl"] == "zbpp" else None
            same = f"{paired(c, twin):.2f}x" if twin else "-"
            w = c["op_means_ms"].get("W")
            lines.append(f"{head} {c['median_ms']:.1f} | {min(c['rep_ms']):.1f}-{max(c['rep_ms']):.1f} | "
                         f"{c['plan_ms']:.1f}{mark} | {c['plan_ms'] / c['median_ms']:.2f} | {c['replay_ms']:.1f} | "
                         f"{c['replay_ms'] / c['median_ms']:.2f} | {vs} | {same} | {_ms(w)} |")
    for source, (mark, who) in notes.items():
        lines.append(f"\n{mark} {who}: plan simulated from {source}")
    return "\n".join(lines)


def replan_table(cells):
    """Configurations that replanned from measured costs: the median step before (the profiled
    steps, less the one the replan ran at the end of), that step, the median after, and whether
    the plan changed; None when none replanned."""
    lines = ["| p | m | costs | configuration | profiled steps | before (ms) | replan step (ms) | after (ms) "
             "| after / before | switched | simulated before -> now (ms, measured costs) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    n = len(lines)
    for cell in cells:
        for c in cell["configs"]:
            rp = c.get("replan")
            if not rp:
                continue
            ratio = f"{rp['after_ms'] / rp['before_ms']:.2f}" if rp.get("before_ms") else "-"
            sims = f"{_ms(rp.get('simulated_before_ms'))} -> {_ms(rp.get('simulated_ms'))}"
            lines.append(f"| {cell['p']} | {cell['m']} | {cell['cost']} | {c['label']} | "
                         f"{rp['profile_steps'][0]}-{rp['profile_steps'][1]} | {_ms(rp.get('before_ms'))} | "
                         f"{_ms(rp.get('replan_step_ms'))} | {rp['after_ms']:.1f} | {ratio} | "
                         f"{'yes' if rp['switched'] else 'no'} | {sims} |")
    return "\n".join(lines) if len(lines) > n else None


def stability_table(launches):
    """One row per launch of the one configuration, then the spread of the post-replan medians
    (max / min - 1) against the 3% target and how many different plans the launches replanned to
    (the digest of the op lists run). launches: the cells, one per launch."""
    rows = [c for cell in launches for c in cell["configs"] if "median_ms" in c]
    if not rows:
        return None
    first = launches[0]
    lines = [f"{rows[0]['label']}, p={first['p']} m={first['m']} {first['cost']}: {len(rows)} separate launches",
             "",
             "| launch | before replan (ms) | replan step (ms) | after replan (ms, median) | reps min-max | switched "
             "| plan run (digest) | plan (ms) | replay (ms) | runtime eff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k, c in enumerate(rows, 1):
        rp = c.get("replan") or {}
        switched = "-" if not rp else ("yes" if rp["switched"] else "no")
        lines.append(f"| {k} | {_ms(rp.get('before_ms'))} | {_ms(rp.get('replan_step_ms'))} | {c['median_ms']:.1f} | "
                     f"{min(c['rep_ms']):.1f}-{max(c['rep_ms']):.1f} | {switched} | {rp.get('digest', '-')[:10]} | "
                     f"{c['plan_ms']:.1f} | "
                     f"{c['replay_ms']:.1f} | {c['replay_ms'] / c['median_ms']:.2f} |")
    after = [c["median_ms"] for c in rows]
    spread = max(after) / min(after) - 1
    verdict = "within" if spread <= STABILITY_TARGET else "NOT within"
    plans = {(c.get("replan") or {}).get("digest") for c in rows}
    lines.append(f"\nspread of the post-replan medians: {min(after):.1f}-{max(after):.1f} ms, "
                 f"{100 * spread:.1f}% ({verdict} the {100 * STABILITY_TARGET:.0f}% target); "
                 f"{len(plans)} different plan(s) run after the replan")
    return "\n".join(lines)


def timeline_svg(cells, want):
    """The measured timeline of configuration `want` in the first cell that ran it, under its plan,
    with torch Schedule1F1B's measured timeline of the same cell for comparison."""
    from zbpp.schedule import stack_svgs

    for cell in cells:
        by = {c["label"]: c for c in cell["configs"] if "median_ms" in c}
        if want not in by:
            continue
        where = f"p={cell['p']} m={cell['m']} {cell['cost']}"
        c, parts = by[want], []
        parts.append((f"{want}: plan ({c['plan_ms']:.1f} ms simulated), {where}", c["plan_svg"]))
        parts.append((f"{want}: measured ({c['measured_span_ms']:.1f} ms; replay of its op times "
                      f"{c['replay_ms']:.1f} ms)", c["timeline_svg"]))
        base = by.get(label(*BASELINE))
        if base is not None and base is not c:
            parts.append((f"{base['label']}: measured ({base['measured_span_ms']:.1f} ms)", base["timeline_svg"]))
        return stack_svgs(parts)
    return None
