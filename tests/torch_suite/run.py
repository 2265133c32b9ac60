#!/usr/bin/env python3
"""Run PyTorch's own torch.distributed.pipelining tests against torch's implementation and against
zbpp.pipelining (the same files with only `torch.distributed.pipelining` -> `zbpp.pipelining` in
their import statements), and compare. See README.md.

  ZBPP_TORCH_PP_TESTS=/path/to/tests python tests/torch_suite/run.py [--results DIR]

Exit status: 0 when zbpp passes every applicable case except the known differences, 1 when some
applicable case fails unexpectedly, 2 when the run could not be made.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_suite import run_variant
from summarize import table, write_summary
from variants import (DEFAULT_VARIANTS, REPO_ROOT, SOURCE_ENV, TEST_FILES, VARIANTS, build,
                      missing_sources, python, zbpp_library_env)


def ensure_deps(results, echo):
    """torch.testing._internal.common_utils needs expecttest: installed into RESULTS/deps with
    pip --target (never into the environment or the repository) unless it is importable there."""
    deps = results / "deps"
    env = dict(os.environ, PYTHONPATH=str(deps))
    if subprocess.run([python(), "-c", "import expecttest"], env=env, capture_output=True).returncode == 0:
        return
    echo(f"installing expecttest into {deps}")
    r = subprocess.run([python(), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        "--target", str(deps), "expecttest"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"pip could not install expecttest into {deps}:\n{r.stdout}{r.stderr}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", help="results directory (default: a new temporary directory); "
                                      "must lie outside the repository")
    ap.add_argument("--source", default=os.environ.get(SOURCE_ENV),
                    help=f"PyTorch's test files (default: ${SOURCE_ENV})")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)} (default: %(default)s)")
    ap.add_argument("--files", nargs="+", choices=TEST_FILES, help="only these test files")
    ap.add_argument("--timeout", type=int, default=int(os.environ.get("TPP_RUN_TIMEOUT", "540")),
                    help="seconds for one pytest invocation (default: %(default)s)")
    args = ap.parse_args(argv)

    def echo(msg):
        print(msg, flush=True)

    missing = missing_sources(args.source)
    if missing:
        echo(f"PyTorch's pipelining test files are not available ({', '.join(missing)}).\n"
             f"Set {SOURCE_ENV} (or --source) to a directory holding {', '.join(TEST_FILES)}, "
             "model_registry.py, schedule_registry.py and artifacts/.")
        return 2
    labels = [lab.strip() for lab in args.variants.split(",") if lab.strip()]
    unknown = [lab for lab in labels if lab not in VARIANTS]
    if unknown:
        echo(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
        return 2
    results = Path(args.results or tempfile.mkdtemp(prefix="zbpp-torch-suite-")).resolve()
    if results == REPO_ROOT or REPO_ROOT in results.parents:
        echo(f"--results {results} lies inside the repository; choose a directory outside it")
        return 2
    results.mkdir(parents=True, exist_ok=True)
    if "zbpp" in labels and not Path(zbpp_library_env()["ZBPP_LIBRARY"]).is_file():
        echo(f"{zbpp_library_env()['ZBPP_LIBRARY']} not found: build the C library or set ZBPP_BUILD_DIR / ZBPP_LIBRARY")
        return 2
    echo(f"results: {results}")
    ensure_deps(results, echo)
    src = Path(args.source).resolve()
    (results / "src").mkdir(exist_ok=True)
    (results / "src" / "SOURCE").write_text(f"{src}\n")
    build(src, results / "src" / "orig", zbpp=False)
    if any(VARIANTS[lab]["source"] == "zbpp" for lab in labels):
        log = build(src, results / "src" / "zbpp", zbpp=True)
        echo(f"zbpp variant: {len(log)} import lines rewritten (src/zbpp/REWRITES.txt)")
    for lab in labels:
        t0 = time.time()
        if run_variant(results, lab, files=args.files, timeout=args.timeout, echo=echo) is not None:
            echo(f"[{lab}] done in {time.time() - t0:.0f}s")
    rows, counts = write_summary(results)
    if "zbpp" in labels:
        echo(table(counts))
    echo(f"summary: {results / 'SUMMARY.md'}")
    return 1 if counts["total"]["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
