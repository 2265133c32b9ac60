"""The docs' examples, run: what the pages show is what the commands print.

1. Every `$ zbpp ...` (or `$ python3 -m zbpp ...`) line in a fenced block of README.md or
   docs/*.md is run (the tool from this build, in an empty folder), and the lines after it, up to the next `$ ` or the block's end, must
   be its output (stdout, then stderr), line by line; `...` in an expected line stands for any text.
   A command with no lines after it is not run (it reads a file the page only describes).
2. docs/getting-started.md's torch example is docs/examples/first_pipeline.py, character for
   character, and it runs as the page says (torchrun, 2 processes) and prints what the page shows.
3. Every relative link of the pages points at a file that exists, and at a heading of it.

To bring the pages' outputs up to date after a change that alters them on purpose:
`ZBPP_BUILD_DIR=build python3 tests/python/test_docs.py --refresh` rewrites each expected output
with the command's (lines with `...` are kept as they are where they still match).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
TIMEOUT = 120


def _tool():
    build = os.environ.get("ZBPP_BUILD_DIR")
    path = Path(build) / "zbpp" if build else ROOT / "build" / "zbpp"
    if not path.is_file():
        pytest.skip(f"no zbpp tool at {path} (set ZBPP_BUILD_DIR to the CMake build)")
    return str(path)


def _blocks(text):
    """(first line number, lines) of each fenced block."""
    out, lines, start = [], None, 0
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            if lines is None:
                lines, start = [], n + 1
            else:
                out.append((start, lines))
                lines = None
        elif lines is not None:
            lines.append(line)
    return out


_TOOL_PREFIXES = ("$ zbpp ", "$ python3 -m zbpp ")


def _examples():
    """(page, line, command, expected lines) of every `$ zbpp` command with output."""
    found = []
    for page in PAGES:
        for start, lines in _blocks(page.read_text()):
            k = 0
            while k < len(lines):
                if lines[k].startswith(_TOOL_PREFIXES):
                    j = k + 1
                    while j < len(lines) and not lines[j].startswith("$ "):
                        j += 1
                    expected = lines[k + 1:j]
                    while expected and not expected[-1].strip():
                        expected.pop()  # the blank line before the next command
                    if expected:
                        found.append((page, start + k, lines[k][2:], expected))
                    k = j
                else:
                    k += 1
    return found


def _matches(expected, got):
    pattern = re.escape(expected.rstrip()).replace(re.escape("..."), ".*")
    return re.fullmatch(pattern, got.rstrip()) is not None


def _run(command, tmp):
    args = shlex.split(command)
    args = args[3:] if args[:3] == ["python3", "-m", "zbpp"] else args[1:]
    proc = subprocess.run([_tool()] + args, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT,
                          env=dict(os.environ, ZBPP_QUIET="1"))
    return proc, (proc.stdout + proc.stderr).rstrip("\n").split("\n")


EXAMPLES = _examples()


@pytest.mark.parametrize("page, line, command, expected", EXAMPLES,
                         ids=[f"{p.name}:{n}" for p, n, _, _ in EXAMPLES])
def test_tool_examples_print_what_the_pages_show(page, line, command, expected, tmp_path):
    proc, got = _run(command, tmp_path)
    assert proc.returncode == 0, f"{page.name}:{line}: {command} failed:\n{proc.stderr}"
    diffs = [f"  line {k + 1}: page {e!r}\n          got  {g!r}" for k, (e, g) in enumerate(zip(expected, got))
             if not _matches(e, g)]
    assert not diffs and len(got) == len(expected), (
        f"{page.name}:{line}: `{command}` prints {len(got)} lines, the page shows {len(expected)}:\n"
        + "\n".join(diffs[:10]) + "\n(refresh: python3 tests/python/test_docs.py --refresh)")


def test_there_are_examples_to_check():
    assert len(EXAMPLES) >= 3, EXAMPLES


def test_the_schedule_table_is_what_zbpp_schedule_prints():
    """docs/schedules.md's table of what each kind gives (p = 4, m = 16): each row's cost, bubble,
    idle and peak are the first line of `zbpp schedule` for it."""
    text = (ROOT / "docs" / "schedules.md").read_text()
    table = text[text.index("| kind | cost | bubble | idle | peak memory |"):]
    rows = re.findall(r"^\| `([a-z0-9-]+)`([^|]*)\| ([\d.]+) \| ([\d.]+)% \| ([\d.]+)% \| ([\d.]+) \|$", table, re.M)
    assert len(rows) >= 8, rows
    for kind, note, cost, bubble, idle, peak in rows:
        extra = ["--times", "1,1,0.5", "--mem-limit", "2p"] if "W = 0.5" in note else []
        proc = subprocess.run([_tool(), "schedule", kind, "-p", "4", "-m", "16"] + extra, capture_output=True,
                              text=True, timeout=TIMEOUT)
        first = proc.stdout.split("\n")[0]
        want = f"cost {cost}  bubble {bubble}%  idle {idle}%  peak memory {peak} "
        assert want in first, f"{kind}{note}: the page says {want!r}, zbpp schedule prints {first!r}"


def _python_block_after(text, marker):
    at = text.index(marker)
    start = text.index("```python\n", at) + len("```python\n")
    return text[start:text.index("```", start)]


def test_the_getting_started_example_is_the_file_and_runs_as_shown(tmp_path):
    pytest.importorskip("torch")
    page = (ROOT / "docs" / "getting-started.md").read_text()
    script = ROOT / "docs" / "examples" / "first_pipeline.py"
    assert _python_block_after(page, "<!-- run: torchrun") == script.read_text(), \
        "docs/getting-started.md's example and docs/examples/first_pipeline.py differ"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bindings" / "python"),
                                                      os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # What the page shows: six loss lines, the replan's one line, the measured step's line, a picture.
    assert len(re.findall(r"^step \d: loss \d+\.\d{4}$", out, re.M)) == 6, out
    assert re.search(r"^zbpp: ScheduleZBVZeroBubble planned zb-v again after step 3 from the costs measured in "
                     r"steps 2-3", proc.stdout + proc.stderr, re.M), proc.stderr[-2000:]
    assert re.search(r"^zb-v, measured step 6: p=2 v=2 m=8  cost [\d.]+  bubble [\d.]+%  idle [\d.]+%", out, re.M), out
    assert (tmp_path / "first_pipeline.svg").stat().st_size > 1000
    shown = page[page.index("Rank 0 prints:"):]
    assert "step 1: loss" in shown and "zb-v, measured step 6: p=2 v=2 m=8" in shown


def _anchor(heading):
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path):
    found, fence = set(), False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            fence = not fence
        m = re.match(r"^#{1,6} (.*)", line)
        if m and not fence:
            found.add(_anchor(m.group(1)))
    return found


def test_relative_links_point_at_files_and_headings():
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading in {dest.name})")
    assert not bad, "\n".join(bad)


def _refresh_once(done):
    """Rewrites the first example not in `done` whose output differs from its command's (keeping
    the lines with `...` that still match); True if one did. An output that changes from run to
    run (a time) needs `...` by hand: each example is rewritten once."""
    import tempfile

    for page, n, command, expected in _examples():
        if (page, command) in done:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            _, got = _run(command, tmp)
        if len(got) == len(expected) and all(_matches(e, g) for e, g in zip(expected, got)):
            continue
        new = [e if _matches(e, g) else g for e, g in zip(expected, got)] + got[len(expected):]
        lines = page.read_text().split("\n")
        lines[n:n + len(expected)] = new  # n: the command's line (1-based), its output after it
        page.write_text("\n".join(lines))
        done.add((page, command))
        print(f"{page.name}:{n}: {command}: refreshed")
        return True
    return False


if __name__ == "__main__":
    if sys.argv[1:] == ["--refresh"]:
        done = set()
        while _refresh_once(done):
            pass
        sys.exit(0)
    sys.exit(pytest.main([__file__, "-q"]))


def test_public_classes_and_functions_show_their_arguments_and_an_example():
    """help() on the public API: every public class and function has a docstring that says more
    than its name; the schedule classes show their real signature (torch's arguments, then zbpp's
    keywords, no bare **kwargs), an example, and a line for every keyword they take."""
    import inspect

    pytest.importorskip("torch")
    import zbpp
    import zbpp.megatron
    import zbpp.pipelining

    thin, schedules = [], []
    for mod in (zbpp, zbpp.pipelining, zbpp.megatron):
        for name in mod.__all__:
            obj = getattr(mod, name, None)
            if not callable(obj) or name.startswith("_") or getattr(obj, "__module__", "").startswith("torch"):
                continue  # (torch's own classes, re-exported as torch has them)
            if len(inspect.getdoc(obj) or "") < 60:
                thin.append(f"{mod.__name__}.{name}")
            if inspect.isclass(obj) and issubclass(obj, zbpp.pipelining.PipelineSchedule) and obj is not \
                    zbpp.pipelining.PipelineSchedule:
                schedules.append(obj)
    assert not thin, f"public names whose help() says almost nothing: {thin}"
    assert len(schedules) >= 15, schedules
    for cls in schedules:
        sig = inspect.signature(cls)
        kinds = [p.kind for p in sig.parameters.values()]
        assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{cls.__name__}{sig}: a bare **kwargs"
        doc = inspect.getdoc(cls)
        assert "Example::" in doc and re.search(rf"\b{cls.__name__}[(),]", doc), f"{cls.__name__}: no example in help()"
        for p in sig.parameters.values():
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                assert re.search(rf"^\s+{p.name}\s", doc, re.M), f"{cls.__name__}: keyword {p.name} is not described"
        for key in ("mem_limit", "plan_from_measured", "offload", "vocab_parallel", "timeout"):
            assert key in sig.parameters, f"{cls.__name__}: help() does not show {key}"
