"""Which torch release the tests run against, for the comparisons with torch's own behaviour.

Why: the suite pins torch 2.13 (.ci/setup), but the lent GPU machine has torch 2.11, whose own
pipelining behaves differently in places zbpp follows 2.13 (uneven microbatches, the calls of its
metadata inference, stages of one process sending to each other through the process group, which
gloo refuses). There, a test that compares zbpp with torch's own run of something 2.11 cannot do
is skipped with the reason, or compares with a reference of its own; zbpp's own checks still run.
"""

import pytest
import torch

from zbpp._ops import _torch_version

RELEASE = _torch_version()  # (major, minor), as zbpp reads it to decide on its torch ops


def older_than(major, minor):
    """Whether the installed torch is older than major.minor."""
    return RELEASE < (major, minor)


def needs(major, minor, what):
    """A skip mark for a comparison with torch's own `what`, which torch before major.minor lacks."""
    return pytest.mark.skipif(older_than(major, minor),
                              reason=f"torch {torch.__version__}'s own pipelining lacks {what} (torch {major}.{minor} has it)")
