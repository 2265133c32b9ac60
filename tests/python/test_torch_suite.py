"""PyTorch's own torch.distributed.pipelining tests, run against zbpp.pipelining (tests/torch_suite).

Needs PyTorch's test files (test_schedule.py, test_schedule_multiproc.py, test_stage.py,
test_microbatch.py, model_registry.py, schedule_registry.py, artifacts/) in the directory named by
$ZBPP_TORCH_PP_TESTS; they are not part of this repository. Without it the module is skipped. The run
takes 15-25 minutes on two CPU cores (every multi-process test spawns its ranks on CPU with gloo), and
pip installs expecttest into the results directory (a pytest temporary directory).

What it proves: every case that passes on torch's own implementation (the baseline variants; the
accelerator gates switched off, CPU and gloo) also passes when the same file imports zbpp.pipelining
instead, except the known differences documented in tests/torch_suite/summarize.py
(KNOWN_DIFFERENCES). It prints applicable / passed / known differences per file and names every
unexpected failure with its reason.
"""

import os
import subprocess
import sys

import pytest

from conftest import BUILD_DIR, REPO_ROOT

ENV = "ZBPP_TORCH_PP_TESTS"
SUITE = REPO_ROOT / "tests" / "torch_suite"
SKIP_HOW = (f"set {ENV} to a directory holding PyTorch's pipelining tests (test_schedule.py, "
            "test_schedule_multiproc.py, test_stage.py, test_microbatch.py, model_registry.py, "
            "schedule_registry.py, artifacts/) to run them against zbpp.pipelining")
RUN_LIMIT = 5400  # seconds for the whole harness; each pytest inside it has its own limit

if not os.environ.get(ENV):
    pytest.skip(f"{ENV} is not set: {SKIP_HOW}", allow_module_level=True)

sys.path.insert(0, str(SUITE))
import summarize  # noqa: E402  (tests/torch_suite)
import variants  # noqa: E402

_missing = variants.missing_sources(os.environ[ENV])
if _missing:
    pytest.skip(f"{ENV}={os.environ[ENV]}: {', '.join(_missing)}; {SKIP_HOW}", allow_module_level=True)


def test_zbpp_passes_torch_pipelining_tests(tmp_path_factory, capsys):
    library = os.environ["ZBPP_LIBRARY"]  # conftest.py: from ZBPP_BUILD_DIR unless set
    if not os.path.isfile(library):
        pytest.fail(f"{library} not found: build first (cmake -S . -B build && cmake --build build) "
                    f"or set ZBPP_BUILD_DIR (now {BUILD_DIR})", pytrace=False)
    results = tmp_path_factory.mktemp("torch_suite")
    cmd = [variants.python(), str(SUITE / "run.py"), "--results", str(results)]
    output = []
    with capsys.disabled():
        print(f"\n$ {' '.join(cmd)}", flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=str(results))
        try:
            for line in proc.stdout:  # a dozen progress lines over the run
                output.append(line)
                print("  " + line, end="", flush=True)
            rc = proc.wait(RUN_LIMIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"tests/torch_suite/run.py ran past {RUN_LIMIT}s; results in {results}", pytrace=False)
    if rc not in (0, 1):  # 1 = unexpected failures, judged below
        pytest.fail(f"tests/torch_suite/run.py exited with {rc}:\n{''.join(output[-40:])}", pytrace=False)

    rows, _data = summarize.compare(results)
    counts = summarize.counts(rows)
    applicable = [r for r in rows if r["applicable"]]
    unexpected = [r for r in applicable if r["verdict"] == "unexpected failure"]
    known = [r for r in applicable if r["verdict"] == "known difference"]
    fixed = [r for r in applicable if r["verdict"] == "passed (known difference no longer fails)"]
    report = [summarize.table(counts), f"(known = documented differences; details: {results / 'SUMMARY.md'})"]
    report += [f"known difference: {r['file']}::{r['name']}: {r['known']}" for r in known]
    report += [f"note: known difference now passes: {r['file']}::{r['name']}" for r in fixed]
    report += [f"UNEXPECTED: {r['file']}::{r['name']}: {r['outcome']['zbpp'] or 'no result'}: "
               f"{r['reason']['zbpp']}" for r in unexpected]
    with capsys.disabled():
        print("\n" + "\n".join(report), flush=True)

    # A vacuous pass (the baseline broke, so nothing is applicable) is a failure too.
    empty = [f for f in variants.TEST_FILES if counts[f]["applicable"] == 0]
    assert not empty, (f"no applicable cases in {empty}: torch's own implementation passed none of them "
                       f"here (see {results}/baseline*/)\n" + "\n".join(report))
    assert not unexpected, (f"{len(unexpected)} case(s) that pass on torch's implementation fail on zbpp:\n"
                            + "\n".join(report))
