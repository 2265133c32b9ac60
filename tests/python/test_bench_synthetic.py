"""benchmarks/bench_synthetic.py's correctness check: step 1 equals the sequential loop.

The benchmark times schedules on stages that sleep fixed F, B and W times; before it times anything
it compares step 1 of every configuration with a sequential loop over the same stages. This runs
that check alone (--check-only) for 2 processes with torch's Schedule1F1B from both imports and
zbpp's zb-v kind (whose W ops run apart from B), with 1 ms sleeps, and asserts every loss and
every parameter's gradient (each stage's scale and its W-only weight) equals the loop's. No time
is asserted.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_synthetic.py"


def test_step_one_equals_the_loop(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(BENCH), "--p", "2", "--m", "4", "--costs", "equal", "--equal-ms", "1",
           "--classes", "Schedule1F1B,zb-v", "--check-only", "--timeout", "60", "--deadline", "150",
           "--out", str(tmp_path), "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert run.returncode == 0, f"bench_synthetic --check-only exited {run.returncode}:\n{run.stderr[-4000:]}"
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 1 and not cells[0].get("failed"), cells
    checks = cells[0]["checks"]
    assert sorted(checks) == ["torch Schedule1F1B", "zbpp Schedule1F1B", "zbpp zb-v"], sorted(checks)
    for config, seen in checks.items():
        # 2 ranks: the losses, and scale and w of each stage (2 stages for 1F1B, 4 for zb-v's V)
        stages = 4 if config.endswith("zb-v") else 2
        assert sorted(seen) == sorted(["losses"] + [f"stage {s} {n}" for s in range(stages) for n in ("scale", "w")])
        for what, (got, want) in seen.items():
            assert got == want, f"{config}: {what} after step 1 is {got}, the sequential loop's is {want}"
        # the gradient of w comes only from W (SleepW's backward): a W that never ran leaves it None
        assert all(seen[f"stage {s} w"][1] != 0 for s in range(stages)), seen
