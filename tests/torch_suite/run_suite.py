"""Run one variant of PyTorch's pipelining tests, file by file.

Every pytest invocation runs in its own process group under a time limit (the whole group, spawned
ranks included, is killed when it runs out). MultiProcContinuousTest "poisons" its class after one
failure (the rest of the class skips with "Previous test failed"): those tests, and tests a killed
run never reached, are run again in a fresh pytest until every test has its own result.

Output in RESULTS/LABEL/: <file>.log (pytest's output), <file>.events.jsonl (shim/tpp_plugin.py),
<file>.worker_errors.jsonl (every rank's exception), results.json (one outcome per test id:
passed, failed, error, skipped or timeout, with pytest's message).
"""
import json
import os
import signal
import subprocess
import time

from variants import PYTHON_SRC, SHIM, TEST_FILES, VARIANTS, python, zbpp_library_env

POISON = "Previous test failed"
TIMEOUT_RCS = (124, 137, -9, -15)


def env_for(label, results):
    v = VARIANTS[label]
    env = dict(os.environ)
    paths = [str(SHIM), str(results / "deps")]
    if v["source"] == "zbpp":
        paths.append(str(PYTHON_SRC))
        env.update(zbpp_library_env())
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["TPP_FORCE_CPU"] = "0" if v["strict"] else "1"
    env["TPP_COMPAT_ALIASES"] = "1" if v["compat"] else "0"
    env.setdefault("TPP_PG_TIMEOUT", "60")
    env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for name in [k for k in env if k.startswith("PYTEST_")]:  # when run from inside pytest
        del env[name]
    return env


def read_events(path, since=0):
    out = []
    if path.exists():
        with open(path) as f:
            for i, line in enumerate(f):
                if i >= since:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    return out


def count_lines(path):
    if not path.exists():
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def pytest(args, cwd, env, events, log, timeout):
    """One pytest run; returns its exit status, 124 when it ran out of time."""
    env = dict(env, TPP_EVENTS=str(events))
    cmd = [python(), "-m", "pytest", "-p", "tpp_plugin", "-p", "no:cacheprovider", "-p", "no:logging",
           "-q", "-rA", "--tb=long"] + args
    t0 = time.time()
    with open(log, "a") as lf:
        lf.write(f"\n===== {time.strftime('%H:%M:%S')} (limit {timeout}s) $ {' '.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = 124
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 30)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        lf.write(f"===== rc={rc} in {time.time() - t0:.0f}s\n")
    return rc


def _final_reports(evs):
    final = {}
    for e in evs:
        if e["ev"] != "report":
            continue
        if e["outcome"] == "failed" or e["when"] == "call" or e["outcome"] == "skipped":
            prev = final.get(e["id"])
            # keep a setup/call failure over a later teardown report
            if prev is None or prev["outcome"] == "passed" or (
                    prev["outcome"] == "skipped" and e["outcome"] == "failed"):
                final[e["id"]] = {"outcome": e["outcome"], "when": e["when"], "msg": e["msg"],
                                  "dur": e.get("dur", 0)}
    return final


def run_file(cwd, fname, outdir, env, timeout):
    stem = fname[:-3]
    events, log = outdir / f"{stem}.events.jsonl", outdir / f"{stem}.log"
    werr = outdir / f"{stem}.worker_errors.jsonl"
    env = dict(env, TPP_WORKER_ERRORS=str(werr))
    for p in (events, log, werr):
        if p.exists():
            p.unlink()
    res = {"file": fname, "collect_error": None, "tests": {}}
    pytest(["--collect-only", fname], cwd, env, events, log, 300)
    evs = read_events(events)
    ids = next((e["ids"] for e in evs if e["ev"] == "collected"), [])
    cerr = [e for e in evs if e["ev"] == "collecterror"]
    if cerr:
        res["collect_error"] = cerr[0]["msg"]
    remaining = list(ids)
    while remaining:
        start = count_lines(events)
        rc = pytest(remaining, cwd, env, events, log, timeout)
        evs = read_events(events, start)
        started = {e["id"] for e in evs if e["ev"] == "start"}
        final = _final_reports(evs)
        redo = []
        for tid in remaining:
            r = final.get(tid)
            if r is None:
                if tid in started and rc in TIMEOUT_RCS:
                    res["tests"][tid] = {"outcome": "timeout", "when": "call",
                                         "msg": f"hang/timeout: pytest killed after {timeout}s while this test ran"}
                else:
                    redo.append(tid)
            elif r["outcome"] == "skipped" and POISON in r["msg"]:
                redo.append(tid)
            else:
                res["tests"][tid] = r
        if len(redo) == len(remaining):  # no progress
            for tid in redo:
                res["tests"][tid] = {"outcome": "error", "when": "run",
                                     "msg": f"harness: no result (pytest rc={rc}), see {log.name}"}
            break
        remaining = redo
    return res


def run_variant(results, label, files=None, timeout=540, echo=print):
    """Run variant `label` on the copies in results/src/ (those of `files` it covers; None if
    none); write results/LABEL/results.json."""
    v = VARIANTS[label]
    files = [f for f in (v["files"] or TEST_FILES) if files is None or f in files]
    if not files:
        return None
    cwd = results / "src" / v["source"]
    outdir = results / label
    outdir.mkdir(parents=True, exist_ok=True)
    env = env_for(label, results)
    rpath = outdir / "results.json"
    allres = json.loads(rpath.read_text()) if rpath.exists() else {}
    allres["_meta"] = {"label": label, **{k: v[k] for k in ("source", "strict", "compat")},
                       "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    for fname in files:
        t0 = time.time()
        r = run_file(cwd, fname, outdir, env, timeout)
        r["seconds"] = round(time.time() - t0)
        allres[fname] = r
        n = {}
        for t in r["tests"].values():
            n[t["outcome"]] = n.get(t["outcome"], 0) + 1
        echo(f"[{label}] {fname}: {n or 'no tests'}"
             f"{' COLLECTION ERROR' if r['collect_error'] else ''} ({r['seconds']}s)")
        rpath.write_text(json.dumps(allres, indent=1))
    return allres
