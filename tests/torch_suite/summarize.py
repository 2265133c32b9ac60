"""Compare the variants' results: RESULTS/SUMMARY.md and RESULTS/per_test.tsv.

A case is *applicable* when it passes on torch's own implementation (baseline, or baseline_compat
for test_stage.py). For each applicable case the zbpp variant's outcome is classed as passed,
known difference (KNOWN_DIFFERENCES, failing as documented) or unexpected failure, with the reason:
the first error line of the failing rank (every rank's exception is recorded; the earliest one that
is not a collective timeout is taken as the cause) or of pytest's report.

Usage: python summarize.py RESULTS_DIR
"""
import ast
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from variants import PYTHON_SRC, REFERENCE_VARIANTS, TEST_FILES, VARIANTS, python, zbpp_library_env

# Cases of PyTorch's tests that zbpp fails on purpose: (file, class, test function) -> why.
# Every parametrization of the function is covered.
KNOWN_DIFFERENCES = {
    ("test_schedule.py", "ScheduleTest", "test_zero_bubble_schedule_errors_with_compile"):
        "zbpp runs compiled (torch.compile) stage modules instead of refusing them with RuntimeError; "
        "for the V schedules it first rejects the test's 1-stage-per-rank set-up with ValueError",
}

CAND = re.compile(
    r"^(?:E\s+)?\s*((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Timeout|Interrupt)|AssertionError)"
    r"(?::\s*(.*))?$")
TIMEOUTISH = re.compile(r"Timed out|timed out|Connection closed by peer|Connection reset|DistBackendError|"
                        r"Broken pipe|closed by peer|ECONNRESET")


def load(results, label):
    p = Path(results) / label / "results.json"
    return json.loads(p.read_text()) if p.exists() else None


# --- reasons -------------------------------------------------------------------------------------

def _where(path):
    if "/torch/distributed/pipelining/" in path:
        return " [raised in torch.distributed.pipelining]"
    if path.startswith(str(PYTHON_SRC / "zbpp") + os.sep):
        return " [raised in zbpp]"
    return ""


def _origin(before, after=()):
    """Where the exception was raised: pytest prints 'path.py:N: ExcType' after the E lines; a
    Python traceback has the last 'File ...' frame before the exception line."""
    for line in after:
        m = re.match(r"^(/[^:\s]+\.py):\d+: \w+$", line)
        if m:
            return _where(m.group(1))
        if line.startswith(("E ", "E\t")) or not line.strip():
            continue
        break
    for line in reversed(before):
        m = re.search(r'File "([^"]+)", line \d+', line) or re.match(r"^(/[^:\s]+\.py):\d+: ", line)
        if m:
            return _where(m.group(1))
    return ""


def first_error_line(text):
    if not text:
        return ""
    lines = text.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if "Exception in worker process" in line), 0)
    for seg in (lines[start:], lines):
        for j, line in enumerate(seg):
            m = CAND.match(line)
            if not m:
                continue
            typ, msg = m.group(1), (m.group(2) or "").strip()
            if "Exception in worker process" in msg or re.match(r"Process \d+ exited with error code", msg):
                continue
            if not msg and typ == "RuntimeError":
                continue
            if "not close" in msg:  # add torch.testing's "Expected a but got b" detail
                extra = [re.sub(r"^E\s+", "", x).strip() for x in seg[j + 1:j + 4]]
                msg += " " + " ".join(x for x in extra if x.startswith(("Expected", "Mismatched", "Greatest")))
            return (f"{typ.split('.')[-1]}: {msg}" if msg else typ) + _origin(seg[:j], seg[j + 1:])
    tail = [line for line in lines if line.strip()]
    return tail[-1].strip()[:200] if tail else ""


def worker_errors(results, label, fname):
    p = Path(results) / label / (fname[:-3] + ".worker_errors.jsonl")
    out = defaultdict(list)
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            cls, meth = r["id"].rsplit(".", 2)[-2:]
            out[f"{fname}::{cls}::{meth}"].append(r)
    return out


def best_worker_error(recs):
    """The real cause: the earliest error that is not a collective timeout, else the earliest."""
    if not recs:
        return None
    recs = sorted(recs, key=lambda r: r["t"])
    for r in recs:
        line = first_error_line(r["tb"])
        if not TIMEOUTISH.search(line):
            return f"[rank {r['rank']}] {line}"
    return f"[rank {recs[0]['rank']}] {first_error_line(recs[0]['tb'])}"


# --- names ---------------------------------------------------------------------------------------

class Names:
    """Readable test names: test_x_ScheduleClass2 -> Class::test_x[ScheduleInterleaved1F1B], from
    the @parametrize lists of the test files."""

    def __init__(self, src):
        self.params, self.funcs = {}, set()
        for fname in TEST_FILES:
            p = Path(src) / fname
            if not p.exists():
                continue
            for node in ast.walk(ast.parse(p.read_text())):
                if not isinstance(node, ast.FunctionDef):
                    continue
                self.funcs.add(node.name)
                for d in node.decorator_list:
                    if (isinstance(d, ast.Call) and getattr(d.func, "id", None) == "parametrize"
                            and len(d.args) >= 2 and isinstance(d.args[0], ast.Constant)
                            and isinstance(d.args[1], ast.List)):
                        first = d.args[0].value.split(",")[0].strip()
                        for i, el in enumerate(d.args[1].elts):
                            if isinstance(el, ast.Tuple):
                                el = el.elts[0]
                            self.params[(node.name, first, i)] = ast.unparse(el)

    def function(self, name):
        return max((f for f in self.funcs if name.startswith(f)), key=len, default=name)

    def pretty(self, tid):
        _file, cls, name = tid.split("::")
        func = self.function(name)
        rest = name[len(func):]
        pat = r"_([A-Za-z_]+?)(\d+)(?=_|$)"
        parts = [self.params[k] for m in re.finditer(pat, rest)
                 if (k := (func, m.group(1), int(m.group(2)))) in self.params]
        extra = re.sub(pat, "", rest).strip("_")
        if extra:
            parts.append(extra)
        return f"{cls}::{func}" + (f"[{','.join(parts)}]" if parts else "")


# --- comparison ----------------------------------------------------------------------------------

def outcome_of(res, results, label, fname, tid, cache):
    """(outcome or None, reason) of test `tid` in one variant's results."""
    fr = res.get(fname) if res else None
    if fr is None:
        return None, ""
    t = fr["tests"].get(tid)
    if t is None:
        if fr.get("collect_error"):
            return "error", first_error_line(fr["collect_error"])
        return None, ""
    oc = t["outcome"]
    if oc == "passed":
        return oc, ""
    if oc == "skipped":
        msg = t["msg"].strip()
        return oc, msg.splitlines()[-1][:150] if msg else ""
    if (label, fname) not in cache:
        cache[(label, fname)] = worker_errors(results, label, fname)
    return oc, best_worker_error(cache[(label, fname)].get(tid)) or first_error_line(t["msg"])


def compare(results, labels=None):
    """One row per test id seen in any variant: outcomes and reasons per variant, whether the case
    is applicable, and (for applicable cases) the zbpp verdict."""
    results = Path(results)
    labels = labels or [lab for lab in VARIANTS if (results / lab / "results.json").exists()]
    data = {lab: load(results, lab) for lab in labels}
    names = Names(results / "src" / "orig")
    cache, rows = {}, []
    for fname in TEST_FILES:
        ids = []
        for lab in labels:
            if data[lab] and fname in data[lab]:
                ids += [t for t in data[lab][fname]["tests"] if t not in ids]
        for tid in ids:
            _f, cls, name = tid.split("::")
            func = names.function(name)
            row = {"id": tid, "file": fname, "name": names.pretty(tid), "outcome": {}, "reason": {}}
            for lab in labels:
                oc, why = outcome_of(data[lab], results, lab, fname, tid, cache)
                row["outcome"][lab], row["reason"][lab] = oc, why
            row["applicable"] = any(row["outcome"].get(lab) == "passed" for lab in REFERENCE_VARIANTS)
            row["known"] = KNOWN_DIFFERENCES.get((fname, cls, func))
            verdict = None
            if row["applicable"] and "zbpp" in labels:
                z = row["outcome"]["zbpp"]
                if z == "passed":
                    verdict = "passed (known difference no longer fails)" if row["known"] else "passed"
                else:
                    verdict = "known difference" if row["known"] else "unexpected failure"
            row["verdict"] = verdict
            rows.append(row)
    return rows, data


def static_import_check(results):
    """Every zbpp.pipelining name the zbpp variant imports, checked against the live package (a run
    stops at the first failing import of a file, so it alone shows only the first)."""
    code = r'''
import ast, importlib, json, os, sys
out = {}
for fn in sorted(os.listdir(sys.argv[1])):
    if not fn.endswith(".py"):
        continue
    miss = []
    for n in ast.walk(ast.parse(open(os.path.join(sys.argv[1], fn)).read())):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("zbpp.pipelining"):
            try:
                m = importlib.import_module(n.module)
            except Exception:
                if n.module + " (no such module)" not in miss:
                    miss.append(n.module + " (no such module)")
                continue
            miss += [f"{n.module}.{a.name}" for a in n.names
                     if not hasattr(m, a.name) and f"{n.module}.{a.name}" not in miss]
    out[fn] = miss
print(json.dumps(out))
'''
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PYTHON_SRC), str(Path(results) / "deps")]),
               TPP_FORCE_CPU="0", TPP_COMPAT_ALIASES="0", **zbpp_library_env())
    try:
        r = subprocess.run([python(), "-c", code, str(Path(results) / "src" / "zbpp")], env=env,
                           cwd=str(results), capture_output=True, text=True, timeout=300)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as exc:  # noqa: BLE001
        return {"(check failed)": [str(exc)]}


def counts(rows):
    """Per file: applicable, zbpp passed, known differences, unexpected failures."""
    out = {}
    for fname in TEST_FILES + ["total"]:
        sel = [r for r in rows if r["applicable"] and (fname == "total" or r["file"] == fname)]
        out[fname] = {
            "applicable": len(sel),
            "passed": sum(1 for r in sel if (r["verdict"] or "").startswith("passed")),
            "known": sum(1 for r in sel if r["verdict"] == "known difference"),
            "unexpected": sum(1 for r in sel if r["verdict"] == "unexpected failure"),
        }
    return out


def table(c):
    lines = [f"{'file':<28} {'applicable':>10} {'passed':>7} {'known':>6} {'unexpected':>10}"]
    for fname, n in c.items():
        lines.append(f"{fname:<28} {n['applicable']:>10} {n['passed']:>7} {n['known']:>6} {n['unexpected']:>10}")
    return "\n".join(lines)


def write_summary(results):
    results = Path(results)
    rows, data = compare(results)
    labels = [lab for lab in VARIANTS if data.get(lab)]
    c = counts(rows)
    md = ["# PyTorch's torch.distributed.pipelining tests: torch's implementation vs zbpp.pipelining\n"]
    md.append(f"Tests from `{(results / 'src' / 'SOURCE').read_text().strip()}`; results in `{results}`.\n"
              if (results / "src" / "SOURCE").exists() else "")
    for lab in labels:
        m = data[lab]["_meta"]
        md.append(f"- `{lab}`: source {m['source']}, strict={m['strict']}, compat={m['compat']}, run {m['when']}")
    md.append("\n## Outcomes per file\n")
    md.append("| file | " + " | ".join(labels) + " |")
    md.append("|---|" + "---|" * len(labels))
    for fname in TEST_FILES:
        cells = []
        for lab in labels:
            n = defaultdict(int)
            for r in rows:
                if r["file"] == fname and r["outcome"].get(lab):
                    n[r["outcome"][lab]] += 1
            fr = data[lab].get(fname)
            if fr and fr.get("collect_error") and not fr["tests"]:
                cells.append("collection error")
            else:
                cells.append(", ".join(f"{k} {v}" for k, v in sorted(n.items())) or "-")
        md.append(f"| {fname} | " + " | ".join(cells) + " |")
    if "zbpp" in labels:
        md.append("\n## zbpp on the applicable cases (those that pass on torch's implementation)\n")
        md.append("```\n" + table(c) + "\n```\n")
        for verdict in ("unexpected failure", "known difference", "passed (known difference no longer fails)"):
            sel = [r for r in rows if r["verdict"] == verdict]
            if sel:
                md.append(f"### {verdict}: {len(sel)}\n")
                md += [f"- `{r['file']}::{r['name']}`: {r['outcome']['zbpp'] or 'no result'}: {r['reason']['zbpp']}"
                       + (f"\n  - documented: {r['known']}" if r["known"] else "") for r in sel]
                md.append("")
        md.append("## zbpp import check (every zbpp.pipelining name the test files import)\n")
        for fn, miss in static_import_check(results).items():
            md.append(f"- {fn}: " + (", ".join(miss) if miss else "all present"))
    md.append("\n## Not applicable (do not pass on torch's implementation)\n")
    for r in rows:
        if not r["applicable"]:
            why = "; ".join(f"{lab}: {r['outcome'][lab]}: {r['reason'][lab][:160]}"
                            for lab in REFERENCE_VARIANTS if r["outcome"].get(lab))
            md.append(f"- `{r['file']}::{r['name']}`: {why}")
    md.append("\n## Per test\n")
    md.append("| test | " + " | ".join(labels) + " | zbpp verdict |")
    md.append("|---|" + "---|" * (len(labels) + 1))
    for r in rows:
        md.append(f"| {r['file']}::{r['name']} | " + " | ".join(r["outcome"][lab] or "-" for lab in labels)
                  + f" | {r['verdict'] or 'n/a'} |")
    (results / "SUMMARY.md").write_text("\n".join(md) + "\n")
    with open(results / "per_test.tsv", "w") as f:
        f.write("\t".join(["test_id", "name", "applicable", "zbpp_verdict"]
                          + [x for lab in labels for x in (lab, lab + "_reason")]) + "\n")
        for r in rows:
            cells = [r["id"], r["file"] + "::" + r["name"], str(r["applicable"]), r["verdict"] or ""]
            cells += [x for lab in labels for x in (r["outcome"][lab] or "-", r["reason"][lab])]
            f.write("\t".join(str(x).replace("\t", " ").replace("\n", " ") for x in cells) + "\n")
    (results / "comparison.json").write_text(json.dumps({"counts": c, "rows": rows}, indent=1))
    return rows, c


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    _rows, _c = write_summary(sys.argv[1])
    print(table(_c))
    print(Path(sys.argv[1]) / "SUMMARY.md")
