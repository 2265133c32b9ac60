"""Writing a user's file whole or not at all.

What this is: write_text(path, text), the Python twin of the zbpp tool's -o: the text goes to a
temporary file in the same folder, which replaces `path` only once every byte is written and
flushed to disk. A write that fails part-way (disk full, a quota, a file-size limit) removes the
temporary and raises, leaving what was at `path` as it was. A new file gets the permissions
open() would give it (0666 less the umask), a replaced one keeps its own; a link is written
through to its target, and a device or pipe (/dev/stdout) is written in place, as the tool does.
What this is not: locking. Two writers of one path race as with open(); the last rename wins.
"""

import os
import stat
import tempfile

__all__ = ["write_text"]


def _umask():
    """The process's umask, read without setting it (os.umask sets it, for a moment, for every
    thread of the process)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def write_text(path, text, encoding="utf-8"):
    path = os.fspath(path)
    real = os.path.realpath(path)  # a link is written through: its target is replaced, not the link
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # A device or a pipe (/dev/stdout, /dev/null): renaming over it would replace the device.
        with open(real, "w", encoding=encoding) as f:
            f.write(text)
        return path
    mode = st.st_mode & 0o7777 if st is not None else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(real) + ".", dir=os.path.dirname(real))
    try:
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
