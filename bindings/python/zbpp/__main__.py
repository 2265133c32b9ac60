"""`python3 -m zbpp ...` and the `zbpp` console script: run the bundled zbpp tool.

What this is: a trampoline. The tool is the C program built with the library; this replaces the
Python process with it (os.execv), so its exit status, signals and output are the tool's own.

What this is not: a second command-line parser; every argument goes to the tool unchanged.
"""

import os
import subprocess
import sys

from . import tool_path

__all__ = ["main"]


def main(argv=None):
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        path = tool_path()
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 127  # the shell's "command not found"
    # argv[0] is "zbpp" so the tool's usage text reads as the user typed it.
    argv0 = "zbpp"
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execv(path, [argv0] + args)  # does not return
    return subprocess.call([path] + args)


if __name__ == "__main__":
    sys.exit(main())
