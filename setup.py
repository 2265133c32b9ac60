"""Builds the zbpp Python distribution: the C library and the zbpp tool come from CMake.

What this is: the small driver that setuptools needs to put native files into a wheel. Before the
Python files are packaged, the build_py step runs CMake (or copies an existing build named by
ZBPP_PREBUILT_DIR) and places libzbpp.so and bin/zbpp inside bindings/python/zbpp/. The metadata
lives in setup.cfg.

What this is not: a second build system. Every compiler flag and every CUDA decision is
CMakeLists.txt's; extra CMake arguments go through ZBPP_CMAKE_ARGS.

Environment:
  ZBPP_CMAKE_ARGS    extra arguments for the CMake configure step (split like a shell would).
  ZBPP_CMAKE_BUILD_DIR  where CMake builds (default build/py-cmake in the source tree).
  ZBPP_PREBUILT_DIR  a CMake build (or install) directory that already holds libzbpp.so and zbpp;
                     it is copied instead of building, and CMake is not needed.
  ZBPP_BUILD_JOBS    parallel build jobs (default: the number of CPUs).
"""

import os
import shlex
import shutil
import stat
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.dist import Distribution
from setuptools.errors import ExecError, SetupError

try:  # setuptools >= 70.1 ships bdist_wheel itself; older ones use the wheel package's.
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - depends on the installed setuptools
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

ROOT = os.path.dirname(os.path.abspath(__file__))
PKG_DIR = os.path.join(ROOT, "bindings", "python", "zbpp")
# Where CMake builds: $ZBPP_CMAKE_BUILD_DIR (e.g. outside the source tree), else build/py-cmake
# (ignored by git; kept between builds, so a rebuild is incremental).
CMAKE_BUILD_DIR = os.path.abspath(os.environ.get("ZBPP_CMAKE_BUILD_DIR") or os.path.join(ROOT, "build", "py-cmake"))
LIB_NAME = "libzbpp.so"
TORCH_LIB_NAME = "libzbpp_torch.so"  # the torch custom ops; built only against torch >= 2.10
TOOL_NAME = "zbpp"


def _find_output(base, name):
    """Where a CMake build or install tree keeps `name` (the build root, or lib/ and bin/)."""
    for sub in ("", "lib", "lib64", "bin"):
        path = os.path.join(base, sub, name)
        if os.path.isfile(path):
            return path
    return None


def _run(cmd):
    print("zbpp: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    try:
        subprocess.run(cmd, cwd=ROOT, check=True)
    except subprocess.CalledProcessError as exc:
        raise ExecError(f"zbpp: command failed with exit status {exc.returncode}: {cmd[0]} ...") from exc


def _cmake_build():
    """Configures and builds the library and tool into build/py-cmake; returns that directory."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SetupError(
            "zbpp: building the C library needs CMake (>= 3.18) and a C compiler, and `cmake` is not "
            "on PATH. On Debian: apt-get install cmake build-essential. Or build it yourself "
            "(cmake -S . -B build && cmake --build build) and set ZBPP_PREBUILT_DIR=build."
        )
    args = [
        cmake,
        "-S", ROOT,
        "-B", CMAKE_BUILD_DIR,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DZB_BUILD_TESTS=OFF",
        "-DZB_BUILD_BENCHMARKS=OFF",
        # The torch ops are built against the torch of the Python running this build (pip's; with
        # build isolation that one has no torch, and the wheel goes without them: ctypes then).
        f"-DZB_PYTHON={sys.executable}",
    ]  # CUDA is left to CMakeLists.txt's auto-detection (ZB_ENABLE_CUDA=AUTO).
    args += shlex.split(os.environ.get("ZBPP_CMAKE_ARGS", ""))
    _run(args)
    # What an earlier build left must not reach this wheel: a libzbpp_torch.so built when that
    # build's Python had torch would be bundled by a build whose Python has none (pip's isolated
    # build), against a torch it never saw. The outputs are made again (a link, not a rebuild).
    for name in os.listdir(CMAKE_BUILD_DIR):
        if name.startswith((LIB_NAME, TORCH_LIB_NAME)) or name == TOOL_NAME:
            path = os.path.join(CMAKE_BUILD_DIR, name)
            if os.path.isfile(path) or os.path.islink(path):
                os.remove(path)
    jobs = os.environ.get("ZBPP_BUILD_JOBS") or str(os.cpu_count() or 1)
    _run([cmake, "--build", CMAKE_BUILD_DIR, "--parallel", jobs])
    return CMAKE_BUILD_DIR


def _copy(src, dst, mode):
    """Copies a file's contents (following symlinks, so libzbpp.so -> .so.0.1.0 arrives whole)."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.lexists(dst):
        os.remove(dst)
    shutil.copyfile(src, dst)
    os.chmod(dst, mode)
    print(f"zbpp: copied {src} -> {os.path.relpath(dst, ROOT)}", flush=True)


def bundle_native():
    """Puts libzbpp.so and bin/zbpp into the package directory, from a prebuilt tree or CMake."""
    prebuilt = os.environ.get("ZBPP_PREBUILT_DIR")
    if prebuilt:
        base = os.path.abspath(prebuilt)
        if not os.path.isdir(base):
            raise SetupError(f"zbpp: ZBPP_PREBUILT_DIR={prebuilt} is not a directory")
    else:
        base = _cmake_build()
    lib = _find_output(base, LIB_NAME)
    tool = _find_output(base, TOOL_NAME)
    missing = [n for n, p in ((LIB_NAME, lib), (TOOL_NAME, tool)) if p is None]
    if missing:
        raise SetupError(
            f"zbpp: {' and '.join(missing)} not found in {base} (looked in it and its lib/, bin/); "
            "was the build complete?"
        )
    exe = stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH  # 0o755
    _copy(lib, os.path.join(PKG_DIR, LIB_NAME), exe)
    _copy(tool, os.path.join(PKG_DIR, "bin", TOOL_NAME), exe)
    ops = _find_output(base, TORCH_LIB_NAME)
    if ops is not None:
        _copy(ops, os.path.join(PKG_DIR, TORCH_LIB_NAME), exe)


def _unbundle_native():
    """Removes the copies from the package directory once they are in the build tree.

    Left there, they would shadow a newer build/libzbpp.so for anyone who imports the package
    from the source checkout (the loader looks in the package directory first).
    """
    for path in (os.path.join(PKG_DIR, LIB_NAME), os.path.join(PKG_DIR, TORCH_LIB_NAME),
                 os.path.join(PKG_DIR, "bin", TOOL_NAME)):
        if os.path.lexists(path):
            os.remove(path)
    try:
        os.rmdir(os.path.join(PKG_DIR, "bin"))
    except OSError:
        pass  # absent, or holds something that is not ours


class BuildPy(build_py):
    """build_py that first bundles the native files, so package_data picks them up."""

    def run(self):
        if not self.dry_run:
            bundle_native()
        # Package data is computed lazily; drop any list made before the files existed.
        self.__dict__.pop("data_files", None)
        super().run()
        # Make sure the tool stays executable in the build tree whatever copy_file did.
        built_tool = os.path.join(self.build_lib, "zbpp", "bin", TOOL_NAME)
        if os.path.isfile(built_tool):
            os.chmod(built_tool, 0o755)
        # An editable install uses the package directory itself, so the copies must stay there.
        if not self.dry_run and not getattr(self, "editable_mode", False):
            _unbundle_native()


class SDist(sdist):
    """sdist that carries the C sources CMake needs and none of the bundled binaries.

    There is no MANIFEST.in (the top level stays small), so the tree is adjusted here: the native
    sources are added, and libzbpp.so / bin/zbpp left in the package by an earlier build are
    dropped, since an sdist must build them for the machine it is installed on.
    """

    NATIVE = ("CMakeLists.txt", "README.md", "include", "csrc", "kernels")

    def make_release_tree(self, base_dir, files):
        pkg = os.path.relpath(PKG_DIR, ROOT)
        bundled = os.path.join(pkg, LIB_NAME), os.path.join(pkg, "bin", TOOL_NAME)
        kept = [f for f in files if not os.path.normpath(f).startswith(bundled)]
        for entry in self.NATIVE:
            path = os.path.join(ROOT, entry)
            if os.path.isfile(path):
                kept.append(entry)
            for dirpath, _dirs, names in os.walk(path):
                kept.extend(os.path.relpath(os.path.join(dirpath, n), ROOT) for n in names)
        super().make_release_tree(base_dir, sorted(set(kept)))


class BinaryDistribution(Distribution):
    """The wheel holds a native library, so it must carry a platform tag."""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": BuildPy, "sdist": SDist}

if bdist_wheel is not None:

    class BdistWheel(bdist_wheel):
        """Platform wheel for any Python 3: the library is loaded by ctypes, not a CPython module."""

        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            _impl, _abi, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = BdistWheel

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
