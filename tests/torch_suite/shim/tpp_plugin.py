"""pytest plugin for tests/torch_suite (loaded with `-p tpp_plugin`).

- Streams one JSON line per event to $TPP_EVENTS (collected ids, collection errors, test start,
  test reports), so results survive the run being killed: a test with a start and no report was
  running when the time limit struck.
- After each test, destroys a default process group the test left initialised (a test that fails
  before its own destroy_process_group() would otherwise make every later test in the file fail
  with "trying to initialize the default process group twice").
"""
import json
import os
import sys
import time

_PATH = os.environ.get("TPP_EVENTS")


def _emit(rec):
    if not _PATH:
        return
    rec["t"] = time.time()
    with open(_PATH, "a") as f:
        f.write(json.dumps(rec) + "\n")


def pytest_collectreport(report):
    if report.failed:
        _emit({"ev": "collecterror", "id": report.nodeid, "msg": str(report.longreprtext)})


def pytest_collection_finish(session):
    _emit({"ev": "collected", "ids": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _emit({"ev": "start", "id": nodeid})


def pytest_runtest_logreport(report):
    msg = ""
    if report.failed:
        msg = str(report.longreprtext)
    elif report.skipped:
        lr = report.longrepr
        msg = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    if report.when == "call" or report.failed or report.skipped:
        _emit({"ev": "report", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
               "msg": msg, "dur": report.duration})


def pytest_runtest_teardown(item, nextitem):
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            _emit({"ev": "cleanup", "id": item.nodeid,
                   "msg": "harness destroyed a leftover default process group"})
    except Exception as exc:  # noqa: BLE001
        _emit({"ev": "cleanup", "id": item.nodeid, "msg": f"cleanup failed: {exc!r}"})
