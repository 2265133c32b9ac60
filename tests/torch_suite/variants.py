"""Paths, the variants, and the import-only rewrite of PyTorch's pipelining tests.

PyTorch's test files are never stored in this repository: they come from the directory named by
$ZBPP_TORCH_PP_TESTS and are copied into the results directory, where the zbpp variant is made.
"""
import ast
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
PYTHON_SRC = REPO_ROOT / "bindings" / "python"
SHIM = HERE / "shim"

SOURCE_ENV = "ZBPP_TORCH_PP_TESTS"
TEST_FILES = ["test_microbatch.py", "test_schedule.py", "test_stage.py", "test_schedule_multiproc.py"]
REQUIRED = TEST_FILES + ["model_registry.py", "schedule_registry.py", "artifacts"]

OLD, NEW = "torch.distributed.pipelining", "zbpp.pipelining"

# label -> how it runs. source: "orig" (the files as given) or "zbpp" (imports rewritten);
# strict: keep the accelerator gates (every multi-process test skips on a CPU-only machine);
# compat: PipeliningShapeError alias (shim/sitecustomize.py); files: None = all TEST_FILES.
VARIANTS = {
    "baseline": dict(source="orig", strict=False, compat=False, files=None),
    "baseline_compat": dict(source="orig", strict=False, compat=True, files=["test_stage.py"]),
    "baseline_strict": dict(source="orig", strict=True, compat=False, files=None),
    "zbpp": dict(source="zbpp", strict=False, compat=False, files=None),
}
DEFAULT_VARIANTS = ["baseline", "baseline_compat", "zbpp"]
# the variants whose passes make a case "applicable": torch's own implementation passes it
REFERENCE_VARIANTS = ["baseline", "baseline_compat"]


def python():
    return os.environ.get("PYTHON") or sys.executable


def zbpp_library_env():
    """ZBPP_LIBRARY / ZBPP_TOOL for the zbpp variant: as set, else from $ZBPP_BUILD_DIR (default
    <repo>/build), the same rule as tests/python/conftest.py."""
    build = Path(os.environ.get("ZBPP_BUILD_DIR") or REPO_ROOT / "build").resolve()
    return {"ZBPP_LIBRARY": os.environ.get("ZBPP_LIBRARY") or str(build / "libzbpp.so"),
            "ZBPP_TOOL": os.environ.get("ZBPP_TOOL") or str(build / "zbpp")}


def missing_sources(src):
    """What is wrong with `src` as the directory of PyTorch's test files (empty list: usable)."""
    if not src:
        return [f"${SOURCE_ENV} is not set"]
    src = Path(src)
    if not src.is_dir():
        return [f"{src} is not a directory"]
    return [f"no {name}" for name in REQUIRED if not (src / name).exists()]


def rewrite(text):
    """`torch.distributed.pipelining` -> `zbpp.pipelining` in import statements only (module-level
    and function-local); returns (new_text, [(line, before, after), ...])."""
    lines = text.splitlines(keepends=True)
    changed = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            hit = bool(node.module) and (node.module == OLD or node.module.startswith(OLD + "."))
        elif isinstance(node, ast.Import):
            hit = any(a.name == OLD or a.name.startswith(OLD + ".") for a in node.names)
        else:
            hit = False
        if not hit:
            continue
        # the module name sits on one of the statement's lines; replace it there only
        for ln in range(node.lineno - 1, node.end_lineno):
            if OLD in lines[ln]:
                before = lines[ln]
                lines[ln] = lines[ln].replace(OLD, NEW)
                changed.append((ln + 1, before.rstrip(), lines[ln].rstrip()))
                break
    return "".join(lines), changed


def build(src, dst, zbpp):
    """Copy the test files from `src` to `dst`; with zbpp=True rewrite their imports (the list of
    changed lines goes to dst/REWRITES.txt). An empty pytest.ini pins pytest's rootdir to `dst`, so
    no configuration above it applies. Returns the list of changed lines."""
    dst = Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc"))
    (dst / "pytest.ini").write_text("[pytest]\n")
    log = []
    if not zbpp:
        return log
    for path in sorted(dst.glob("*.py")):
        text = path.read_text()
        new, changed = rewrite(text)
        # nothing but the module names changed
        assert new.replace(NEW, OLD) == text.replace(NEW, OLD), path.name
        compile(new, str(path), "exec")
        path.write_text(new)
        log += [f"{path.name}:{ln}: {a.strip()}  ->  {b.strip()}" for ln, a, b in changed]
    (dst / "REWRITES.txt").write_text("\n".join(log) + "\n")
    return log
