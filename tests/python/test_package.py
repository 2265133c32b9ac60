"""The Python package as a user gets it: the wheel, its installed layout, its CLI, its errors.

Wheels are built offline (pip --no-build-isolation, Debian's setuptools and wheel) from a copy of
the source tree, so the checkout is not written to. The fast path copies the CMake build under test
(ZBPP_PREBUILT_DIR); one test also goes the slow way, sdist -> wheel with CMake, as `pip install`
from a source archive would.
"""

import configparser
import ctypes
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import REPO_ROOT

PYTHON = sys.executable
TIMEOUT_S = 600
# Variables that steer the build or the loader; cleared so each test states what it uses.
_STEERING_ENV = ("ZBPP_LIBRARY", "ZBPP_TOOL", "ZBPP_PREBUILT_DIR", "ZBPP_CMAKE_ARGS", "PYTHONPATH")


def _cfg_version():
    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    return cfg["metadata"]["version"]


def _status_from_header(name):
    """(value, text) of a status in include/zbpp.h's X-macro list: the ABI a caller relies on."""
    header = (REPO_ROOT / "include" / "zbpp.h").read_text()
    found = re.search(r"X\(\s*" + name + r'\s*,\s*(\d+)\s*,\s*"([^"]*)"\s*\)', header)
    assert found, f"{name} not found in include/zbpp.h"
    return int(found.group(1)), found.group(2)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _STEERING_ENV}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(cmd, env, cwd, check=True):
    proc = subprocess.run(
        [str(c) for c in cmd], env=env, cwd=str(cwd), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if check:
        assert proc.returncode == 0, (
            f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
        )
    return proc


def _copy_source(dst):
    """Copies the checkout minus build outputs, VCS data and bundled binaries from earlier builds."""
    pkg = REPO_ROOT / "bindings" / "python" / "zbpp"

    def ignore(directory, names):
        here = Path(directory).resolve()
        skipped = {n for n in names if n in ("__pycache__", ".pytest_cache") or n.endswith(".egg-info")}
        if here == REPO_ROOT:
            skipped |= {n for n in names if n.startswith(("build", "dist", ".git", "zbpp-out"))}
        if here == pkg:
            skipped |= {n for n in names if n == "bin" or n.startswith("libzbpp.so")}
        return skipped

    shutil.copytree(REPO_ROOT, dst, ignore=ignore, symlinks=True)
    return dst


def _pip_wheel(src, out_dir, env):
    _run([PYTHON, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", out_dir, src],
         env=env, cwd=src)
    wheels = sorted(Path(out_dir).glob("zbpp-*.whl"))
    assert len(wheels) == 1, f"expected one zbpp wheel in {out_dir}, found {wheels}"
    return wheels[0]


@pytest.fixture(scope="module")
def wheel(build_dir, tmp_path_factory):
    """A wheel built offline from a copy of the source, bundling the build under test."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_source(tmp / "src")
    return _pip_wheel(src, tmp / "dist", _env(ZBPP_PREBUILT_DIR=build_dir))


@pytest.fixture(scope="module")
def repaired(build_dir, tmp_path_factory):
    """The wheel users install: .ci/wheel's (pip wheel, then auditwheel repair: manylinux, its BLAS
    inside), from a copy of the source with the build under test, this test's environment."""
    venv = Path(PYTHON).parent.parent
    if not (venv / "bin" / "auditwheel").is_file():
        pytest.skip(f"auditwheel is not installed in {venv} (.ci/setup installs it)")
    src = _copy_source(tmp_path_factory.mktemp("repair") / "src")
    _run(["bash", src / ".ci" / "wheel"], env=_env(ZBPP_PREBUILT_DIR=build_dir, ZBPP_VENV=venv), cwd=src)
    wheels = sorted((src / "dist").glob("zbpp-*manylinux*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel installed with pip into a plain directory (pip install --target)."""
    target = tmp_path_factory.mktemp("target")
    _run([PYTHON, "-m", "pip", "install", "--no-deps", "--no-index", "--target", target, wheel],
         env=_env(), cwd=target)
    return target


def _in_installed(installed, tmp_path):
    """Environment and cwd that see only the installed package, not the source tree."""
    return _env(PYTHONPATH=installed), tmp_path


def test_wheel_bundles_library_and_tool(wheel, build_dir):
    with zipfile.ZipFile(wheel) as zf:
        infos = {info.filename: info for info in zf.infolist()}
        for name in ("zbpp/__init__.py", "zbpp/_lib.py", "zbpp/__main__.py", "zbpp/libzbpp.so", "zbpp/bin/zbpp"):
            assert name in infos, f"{name} missing from {wheel.name}: {sorted(infos)}"
        mode = infos["zbpp/bin/zbpp"].external_attr >> 16
        assert mode & 0o111 == 0o111, f"zbpp/bin/zbpp has mode {oct(mode)}, want executable (755)"
        # The bundled library is the build's library itself, not a symlink stub or a stale copy.
        bundled = zf.read("zbpp/libzbpp.so")
        assert bundled == (build_dir / "libzbpp.so").resolve().read_bytes(), "bundled libzbpp.so differs from the build's"
        assert zf.read("zbpp/bin/zbpp") == (build_dir / "zbpp").read_bytes(), "bundled tool differs from the build's"
        wheel_meta = next(n for n in infos if n.endswith(".dist-info/WHEEL"))
        meta = zf.read(wheel_meta).decode()
    # name-version-python-abi-platform.whl: a native library inside means a platform tag.
    _name, version, _py, abi, plat = wheel.stem.split("-")
    assert version == _cfg_version()
    assert (abi, plat) != ("none", "any") and plat != "any", f"wheel {wheel.name} has no platform tag"
    assert "Root-Is-Purelib: false" in meta, meta


def test_installed_package_loads_its_bundled_library(installed, tmp_path):
    env, cwd = _in_installed(installed, tmp_path)
    script = (
        "import importlib.metadata, json, sys, zbpp\n"
        "print(json.dumps({'file': zbpp.__file__, 'lib': zbpp.library_path(), 'tool': zbpp.tool_path(),\n"
        "  'version': zbpp.version(), 'code': zbpp.version_code(), 'pkg': zbpp.__version__,\n"
        "  'dist': importlib.metadata.version('zbpp'), 'torch': 'torch' in sys.modules}))\n"
    )
    got = json.loads(_run([PYTHON, "-c", script], env=env, cwd=cwd).stdout)
    target = str(Path(installed).resolve())
    for key in ("file", "lib", "tool"):
        assert str(Path(got[key]).resolve()).startswith(target), f"{key} = {got[key]} is not inside {target}"
    want = _cfg_version()
    major, minor, patch = (int(x) for x in want.split("."))
    assert (got["version"], got["pkg"], got["dist"]) == (want, want, want), got
    assert got["code"] == major * 10000 + minor * 100 + patch, got
    assert got["torch"] is False, "importing zbpp and loading the library must not import torch"


def test_installed_package_has_the_torch_ops_its_build_made(wheel, installed, build_dir, tmp_path):
    """A build with libzbpp_torch.so (torch >= 2.10) ships it, and the installed package loads it
    into torch: zbpp::wgrad runs from the installed copy."""
    if not (build_dir / "libzbpp_torch.so").is_file():
        pytest.skip("this build has no libzbpp_torch.so (its torch is older than 2.10, or ZB_TORCH_OPS=OFF)")
    with zipfile.ZipFile(wheel) as zf:
        assert "zbpp/libzbpp_torch.so" in zf.namelist()
    env, cwd = _in_installed(installed, tmp_path)
    script = (
        "import torch, zbpp\n"
        "from zbpp import _ops\n"
        "ops = _ops.stable()\n"
        "assert ops is not None, _ops.stable_unavailable()\n"
        "x, dy, dw = torch.randn(5, 3), torch.randn(5, 2), torch.zeros(2, 3)\n"
        "ops.wgrad(x, dy, dw)\n"
        "torch.testing.assert_close(dw, dy.t() @ x)\n"
        "print(_ops.stable_library_path())\n"
    )
    path = _run([PYTHON, "-c", script], env=env, cwd=cwd).stdout.strip()
    assert str(Path(path).resolve()).startswith(str(Path(installed).resolve())), path


def test_the_wheel_in_a_fresh_environment_without_a_compiler_runs_the_docs_example(repaired, tmp_path):
    """What a user without a compiler does: a fresh virtual environment, pip install of the wheel
    .ci/wheel makes (its dependencies, numpy and torch, found where the environment sees them: here
    this test's own site-packages, so nothing is downloaded), then the CLI and
    docs/getting-started.md's torch example from it, with a PATH that holds no compiler (only the
    environment's bin/). The wheel is manylinux and its library and tool take their BLAS from the
    wheel, not from the machine."""
    wheel = repaired
    pytest.importorskip("torch")
    import sysconfig
    import venv

    fresh = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(fresh)
    py = fresh / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=_env(),
                     cwd=tmp_path).stdout.strip())
    # torch and numpy as the user's environment has them: this test's site-packages, behind the
    # fresh one's own (pip sees their metadata there and installs neither).
    (site / "_outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    bare = tmp_path / "bin-only"
    bare.mkdir()
    env = _env(PATH=f"{fresh / 'bin'}:{bare}", VIRTUAL_ENV=fresh)
    for tool in ("cc", "gcc", "cmake", "c++"):
        assert _run(["/bin/sh", "-c", f"command -v {tool} || true"], env=env, cwd=tmp_path).stdout.strip() == ""
    # pip from this interpreter, installing into the fresh environment (it has no pip of its own).
    _run([PYTHON, "-m", "pip", "--python", py, "install", "--no-index", wheel], env=env, cwd=tmp_path)
    out = _run([fresh / "bin" / "zbpp", "schedule", "zb-v", "-p", "4", "-m", "8"], env=env, cwd=tmp_path).stdout
    assert out.startswith("zb-v: p=4 v=2 m=8  cost 24  bubble 0.00%  idle 5.88%"), out
    script = REPO_ROOT / "docs" / "examples" / "first_pipeline.py"
    proc = _run([py, "-m", "torch.distributed.run", "--nproc-per-node", "2", script], env=_env(
        PATH=f"{fresh / 'bin'}:{bare}", OMP_NUM_THREADS=1, ZBPP_QUIET=1), cwd=tmp_path)
    assert "step 6: loss" in proc.stdout and (tmp_path / "first_pipeline.svg").is_file(), proc.stdout[-2000:]
    where = _run([py, "-c", "import zbpp; print(zbpp.__file__)"], env=env, cwd=tmp_path).stdout.strip()
    assert where.startswith(str(fresh)), f"zbpp came from {where}, not the fresh environment"
    assert "manylinux" in wheel.name, wheel.name
    # One copy of the library in the process: the torch ops bind to the libzbpp.so Python loaded
    # (a second copy, grafted by a repair, would hold W stores of its own).
    maps = _run([py, "-c", "import torch, zbpp\nfrom zbpp import _ops\nassert _ops.stable() is not None, "
                 "_ops.stable_unavailable()\nprint(open('/proc/self/maps').read())"], env=env, cwd=tmp_path).stdout
    copies = {line.split()[-1] for line in maps.splitlines() if "libzbpp" in line and "libzbpp_torch" not in line}
    assert len(copies) == 1, f"libzbpp is mapped from {sorted(copies)}"
    pkg = Path(where).parent
    for binary in (pkg / "libzbpp.so", pkg / "bin" / "zbpp"):
        deps = _run(["/usr/bin/ldd", binary], env=_env(), cwd=tmp_path).stdout
        blas = [line for line in deps.splitlines() if "blas" in line]
        assert blas and all("zbpp.libs" in line for line in blas), f"{binary.name}: {blas}"


def test_the_wheel_declares_numpy_and_an_unpinned_torch(wheel):
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = sorted(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:"))
    assert requires == ["numpy", "torch"], requires


def test_python_m_zbpp_help_lists_kinds(installed, tmp_path):
    env, cwd = _in_installed(installed, tmp_path)
    proc = _run([PYTHON, "-m", "zbpp", "--help"], env=env, cwd=cwd)
    assert "zb-v" in proc.stdout + proc.stderr, f"--help does not mention zb-v:\n{proc.stdout}\n{proc.stderr}"


def test_console_script_runs_the_tool(installed, tmp_path):
    env, cwd = _in_installed(installed, tmp_path)
    script = Path(installed) / "bin" / "zbpp"
    assert script.is_file(), f"pip did not install the console script at {script}"
    proc = _run([script, "--help"], env=env, cwd=cwd)
    assert "zb-v" in proc.stdout + proc.stderr, f"zbpp --help does not mention zb-v:\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize(
    "args",
    [["schedule", "zb-v", "-p", "4", "-m", "8"], ["schedule", "no-such-kind", "-p", "4", "-m", "8"]],
    ids=["good", "bad-kind"],
)
def test_python_m_zbpp_is_the_tool(installed, tmp_path, args):
    """`python -m zbpp ARGS` behaves exactly like the bundled tool: same output, same exit status."""
    env, cwd = _in_installed(installed, tmp_path)
    via_python = _run([PYTHON, "-m", "zbpp", *args], env=env, cwd=cwd, check=False)
    direct = _run([Path(installed) / "zbpp" / "bin" / "zbpp", *args], env=env, cwd=cwd, check=False)
    assert (via_python.returncode, via_python.stdout) == (direct.returncode, direct.stdout)
    if args[1] == "no-such-kind":
        assert direct.returncode != 0, "an unknown kind must be an error"
        assert "no-such-kind" in direct.stderr or "zb-v" in direct.stderr, (
            f"the error should name the bad kind or the valid ones: {direct.stderr!r}")
    else:
        assert direct.returncode == 0, direct.stderr
        assert direct.stdout.strip(), "zbpp schedule zb-v printed nothing"


def test_missing_library_error_names_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "libzbpp.so"
    script = (
        "import zbpp\n"  # must import fine: the library loads on first use
        "try:\n    zbpp.version()\n"
        "except OSError as exc:\n    print(exc)\n    raise SystemExit(3)\n"
    )
    proc = _run([PYTHON, "-c", script], env=_env(PYTHONPATH=REPO_ROOT / "bindings" / "python", ZBPP_LIBRARY=missing),
                cwd=tmp_path, check=False)
    assert proc.returncode == 3, f"expected OSError from zbpp.version(), got rc {proc.returncode}: {proc.stderr}"
    message = proc.stdout
    assert str(missing) in message, message
    assert "ZBPP_LIBRARY" in message and "cmake" in message, f"message should say how to get the library: {message}"


def test_unloadable_library_error_names_the_path(tmp_path):
    bogus = tmp_path / "libzbpp.so"
    bogus.write_text("not an ELF file\n")
    script = "import zbpp\ntry:\n    zbpp.version()\nexcept OSError as exc:\n    print(exc)\n    raise SystemExit(3)\n"
    proc = _run([PYTHON, "-c", script], env=_env(PYTHONPATH=REPO_ROOT / "bindings" / "python", ZBPP_LIBRARY=bogus),
                cwd=tmp_path, check=False)
    assert proc.returncode == 3, f"expected OSError, got rc {proc.returncode}: {proc.stderr}"
    assert f"cannot load {bogus}" in proc.stdout, proc.stdout


def test_check_raises_zberror_with_the_library_message(build_dir, tmp_path):
    """A failing C call becomes ZbError(code, zb_last_error()) named by zb_status_string."""
    code, text = _status_from_header("ZB_ERR_INVALID_ARGUMENT")
    script = (
        "import ctypes, json, zbpp\n"
        "from zbpp import _lib\n"
        "L = _lib.lib()\n"
        "f = L.zb_kind_from_name\n"
        "f.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_double)]\n"
        "f.restype = ctypes.c_int\n"
        "kind, factor = ctypes.c_int(-1), ctypes.c_double(0)\n"
        "assert _lib.check(f(b'zb-v', ctypes.byref(kind), ctypes.byref(factor))) is None\n"
        "try:\n"
        "    _lib.check(f(b'no-such-kind', ctypes.byref(kind), ctypes.byref(factor)))\n"
        "except zbpp.ZbError as e:\n"
        "    print(json.dumps({'code': e.code, 'name': e.name, 'message': e.message, 'str': str(e)}))\n"
    )
    env = _env(PYTHONPATH=REPO_ROOT / "bindings" / "python", ZBPP_LIBRARY=build_dir / "libzbpp.so")
    out = _run([PYTHON, "-c", script], env=env, cwd=tmp_path).stdout
    assert out.strip(), "check() did not raise ZbError for an unknown kind"
    got = json.loads(out)
    assert got["code"] == code and got["name"] == text, got
    assert text in got["str"] and got["message"] in got["str"], got
    assert "zb-v" in got["message"], f"the message should list the valid kinds: {got['message']!r}"


def test_zberror_survives_pickling():
    # Errors cross process boundaries (torch.multiprocessing.spawn); they must keep their fields.
    from zbpp import ZbError

    err = ZbError(3, "rank 1: channel 0->1 out of order", "schedule breaks a rule")
    back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.message, back.name, str(back)) == (err.code, err.message, err.name, str(err))
    assert str(err) == "schedule breaks a rule (zb status 3): rank 1: channel 0->1 out of order"


def test_build_without_cmake_or_prebuilt_says_what_to_do(tmp_path):
    src = _copy_source(tmp_path / "src")
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    proc = _run([PYTHON, "setup.py", "build_py"], env=_env(PATH=empty_bin), cwd=src, check=False)
    assert proc.returncode != 0, "setup.py build_py succeeded without cmake"
    err = proc.stderr + proc.stdout
    assert "CMake" in err and "ZBPP_PREBUILT_DIR" in err, err[-2000:]


def test_prebuilt_dir_without_outputs_is_an_error(tmp_path):
    src = _copy_source(tmp_path / "src")
    empty = tmp_path / "empty-build"
    empty.mkdir()
    proc = _run([PYTHON, "setup.py", "build_py"], env=_env(ZBPP_PREBUILT_DIR=empty), cwd=src, check=False)
    assert proc.returncode != 0, "setup.py build_py succeeded with an empty ZBPP_PREBUILT_DIR"
    assert f"not found in {empty}" in proc.stderr + proc.stdout, (proc.stderr + proc.stdout)[-2000:]


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_sdist_builds_a_working_wheel_with_cmake(tmp_path):
    """The slow path: an sdist carries the C sources (and no stale binaries) and CMake builds them."""
    src = _copy_source(tmp_path / "src")
    # A stale binary left in the package by an earlier build must not end up in the sdist.
    (src / "bindings" / "python" / "zbpp" / "libzbpp.so").write_bytes(b"stale")
    _run([PYTHON, "setup.py", "-q", "sdist", "-d", tmp_path / "sdist"], env=_env(), cwd=src)
    (archive,) = (tmp_path / "sdist").glob("zbpp-*.tar.gz")
    with tarfile.open(archive) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
        for needed in ("CMakeLists.txt", "include/zbpp.h", "setup.py", "setup.cfg", "pyproject.toml",
                       "bindings/python/zbpp/__init__.py", "csrc/tool/main.c"):
            assert needed in names, f"{needed} missing from {archive.name}"
        assert not [n for n in names if "libzbpp.so" in n or n.endswith("bin/zbpp")], "binaries in the sdist"
        tf.extractall(tmp_path / "unpacked")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    # An earlier build's outputs left in CMake's build directory (here out of the tree) must not
    # reach this wheel: a torch ops library from a build whose Python had torch, where this build
    # makes none (ZB_TORCH_OPS=OFF stands for a Python without torch, as pip's isolated build).
    cmake_dir = tmp_path / "cmake-build"
    cmake_dir.mkdir()
    (cmake_dir / "libzbpp_torch.so").write_bytes(b"stale")
    whl = _pip_wheel(unpacked, tmp_path / "dist", _env(ZBPP_CMAKE_ARGS="-DZB_ENABLE_CUDA=OFF -DZB_TORCH_OPS=OFF",
                                                       ZBPP_CMAKE_BUILD_DIR=cmake_dir))
    assert (cmake_dir / "CMakeCache.txt").is_file(), "CMake did not build in ZBPP_CMAKE_BUILD_DIR"
    assert not (unpacked / "build" / "py-cmake").exists(), "CMake built in the source tree all the same"
    with zipfile.ZipFile(whl) as zf:
        assert "zbpp/libzbpp_torch.so" not in zf.namelist(), "a stale torch ops library went into the wheel"
        mode = zf.getinfo("zbpp/bin/zbpp").external_attr >> 16
        assert mode & 0o111 == 0o111, f"the CMake-built tool has mode {oct(mode)} in the wheel"
        zf.extractall(tmp_path / "whl")
    built = ctypes.CDLL(str(tmp_path / "whl" / "zbpp" / "libzbpp.so"))
    built.zb_version.restype = ctypes.c_char_p
    assert built.zb_version().decode() == _cfg_version()
