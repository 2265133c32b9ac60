"""gpt_runs.py - what the GPT-example benchmarks share: one `python3 -m zbpp.examples.train_gpt`
run as a user runs it, a fresh set of processes, with this checkout's binding on the path; its
standard output, or RuntimeError with the end of its standard error when it fails."""

import os
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_gpt(args, timeout):
    """The standard output of train_gpt with the command-line arguments `args` (a list)."""
    cmd = [sys.executable, "-m", "zbpp.examples.train_gpt", *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(_REPO, "bindings", "python"),
                                                       env.get("PYTHONPATH")]))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return out.stdout
