"""Harness shim for tests/torch_suite (not part of PyTorch's tests; the test files stay untouched).

Imported at interpreter start because run_suite.py puts this directory first on PYTHONPATH, so it
acts in the pytest process and in every rank the tests spawn. What it does depends on the
environment run_suite.py sets:

TPP_FORCE_CPU=1 (every variant except baseline_strict)
    PyTorch's pipelining tests gate every multi-process test on accelerators
    (requires_accelerator_dist_backend(["nccl", "xccl"]), TEST_MULTIACCELERATOR, skip_if_lt_x_gpu,
    requires_nccl); on a CPU-only machine they would all skip. The tests themselves choose device
    "cpu" and backend "gloo" when no accelerator is present, so only those gates are switched off,
    right after torch's testing modules are imported. Also:
    - torch.cpu.device_count() returns TPP_CPU_DEVICE_COUNT (default 2): classes without a fixed
      world_size (test_stage.py) size themselves by the device count;
    - MultiProcContinuousTest.timeout = TPP_PG_TIMEOUT seconds, if set, so that a rank stuck in a
      collective fails sooner;
    - every rank's exception is appended to TPP_WORKER_ERRORS (JSON lines): the test framework
      reports only the lowest failing rank's, often a timeout caused by another rank's real error.

TPP_COMPAT_ALIASES=1 (baseline_compat)
    torch 2.13 renamed pipelining._utils.PipeliningShapeError to PipeliningMetadataError; the
    stored test_stage.py imports the old name and so does not import on torch 2.13's own
    implementation. The alias puts the old name back, so that the file runs on torch's
    implementation and tells which of its cases are applicable.
"""
import os
import sys


def _wrapping_finder(names, patch):
    """A meta-path finder that runs patch(name, module) right after one of `names` is executed."""
    import importlib.abc
    import importlib.machinery

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner, name):
            self._inner, self._name = inner, name

        def create_module(self, spec):
            return self._inner.create_module(spec)

        def exec_module(self, module):
            self._inner.exec_module(module)
            patch(self._name, module)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in names:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
            return spec

    return _Finder()


def _identity_decorator(*_a, **_k):
    return lambda f: f


def _record_worker_errors(mod):
    path = os.environ.get("TPP_WORKER_ERRORS")
    if not path:
        return
    cls = mod.MultiProcContinuousTest
    orig = cls.__dict__["_run_test_given_id"].__func__

    def _run_test_given_id(klass, test_id, **kwargs):
        try:
            return orig(klass, test_id, **kwargs)
        except BaseException as exc:
            import json
            import time
            import traceback

            with open(path, "a") as f:
                f.write(json.dumps({"id": test_id, "rank": klass.rank, "t": time.time(),
                                    "type": type(exc).__name__, "tb": traceback.format_exc()}) + "\n")
            raise

    cls._run_test_given_id = classmethod(_run_test_given_id)


def _force_cpu(name, mod):
    if name == "torch.testing._internal.common_utils":
        mod.TEST_MULTIACCELERATOR = True
        return
    # torch.testing._internal.common_distributed
    mod.requires_accelerator_dist_backend = _identity_decorator
    mod.skip_if_lt_x_gpu = _identity_decorator
    mod.requires_nccl = _identity_decorator
    _record_worker_errors(mod)
    n = int(os.environ.get("TPP_CPU_DEVICE_COUNT", "2"))
    if n > 1:
        import torch

        torch.cpu.device_count = lambda: n
    timeout = os.environ.get("TPP_PG_TIMEOUT")
    if timeout:
        from datetime import timedelta

        mod.MultiProcContinuousTest.timeout = timedelta(seconds=int(timeout))


def _compat_aliases(name, mod):
    if not hasattr(mod, "PipeliningShapeError") and hasattr(mod, "PipeliningMetadataError"):
        mod.PipeliningShapeError = mod.PipeliningMetadataError


if os.environ.get("TPP_FORCE_CPU") == "1":
    sys.meta_path.insert(0, _wrapping_finder(
        {"torch.testing._internal.common_utils", "torch.testing._internal.common_distributed"}, _force_cpu))

if os.environ.get("TPP_COMPAT_ALIASES") == "1":
    sys.meta_path.insert(0, _wrapping_finder({"torch.distributed.pipelining._utils"}, _compat_aliases))
