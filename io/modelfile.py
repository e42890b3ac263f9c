"""A model file as the I/O layer sees it: one descriptor, O_DIRECT when allowed, an identity to check.

A model split into parts is several of them (:func:`open_files`), one per part.

A file whose size or mtime changed after it was opened may no longer hold the
bytes the model's index points at, so every read checks the file's identity
before it is submitted and again before its bytes reach compute.
"""
from __future__ import annotations

import errno
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from colibri_aio.errors import ModelFormatError, UserError
from colibri_aio.io.align import ALIGN
from colibri_aio.logs import get_logger

log = get_logger("colibri_aio.io")

O_DIRECT = getattr(os, "O_DIRECT", 0)


class ModelFileChangedError(ModelFormatError):
    """The model file's size or mtime changed since it was opened."""


@dataclass(frozen=True, slots=True)
class FileIdentity:
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileIdentity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ModelFile:
    """An open model file: ``fd`` reads with O_DIRECT when ``direct`` is true."""

    def __init__(self, path: str, fd: int, direct: bool, direct_reason: str, identity: FileIdentity) -> None:
        self.path = path
        self.fd = fd
        self.direct = direct
        self.direct_reason = direct_reason
        self.identity = identity

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, direct: bool = True) -> "ModelFile":
        """Open ``path`` for reading, with O_DIRECT if asked and the file system allows it."""
        path = os.fspath(path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise UserError(f"{path}: no such file") from None
        except OSError as exc:
            raise UserError(f"{path}: cannot open: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{path}: not a regular file")
        fd, used_direct, reason = _open_fd(path, direct)
        identity = FileIdentity.of(os.fstat(fd))
        return cls(path, fd, used_direct, reason, identity)

    @property
    def size(self) -> int:
        return self.identity.size

    def check_unchanged(self) -> None:
        """Refuse to go on if the file was truncated, grown or rewritten since it was opened."""
        # fstat, not stat: a file replaced by rename leaves our descriptor on
        # the old, unchanged inode, whose bytes are still the right ones.
        st = os.fstat(self.fd)
        seen = self.identity
        if st.st_size != seen.size or st.st_mtime_ns != seen.mtime_ns:
            now = FileIdentity.of(st)
            raise ModelFileChangedError(
                f"{self.path}: the model file changed since it was opened "
                f"(size {self.identity.size} -> {now.size} bytes, "
                f"mtime_ns {self.identity.mtime_ns} -> {now.mtime_ns}); refusing to read from it")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_files(paths: Sequence[str | os.PathLike[str]], *, direct: bool = True) -> tuple[ModelFile, ...]:
    """Every file of a model (the parts of a split GGUF, in order), each as :meth:`ModelFile.open` opens it;
    none is left open if one fails."""
    files: list[ModelFile] = []
    try:
        for path in paths:
            files.append(ModelFile.open(path, direct=direct))
    except BaseException:
        for f in files:
            f.close()
        raise
    return tuple(files)


def _open_fd(path: str, direct: bool) -> tuple[int, bool, str]:
    """A read-only descriptor, O_DIRECT when asked for and the file system accepts it."""
    flags = os.O_RDONLY | os.O_CLOEXEC
    if not direct:
        return os.open(path, flags), False, "buffered reads requested"
    if not O_DIRECT:
        return os.open(path, flags), False, "O_DIRECT is not available on this platform"
    try:
        fd = os.open(path, flags | O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        reason = f"the file system refuses O_DIRECT at open ({exc.strerror})"
    else:
        refusal = _direct_read_refused(fd)
        if refusal is None:
            return fd, True, "O_DIRECT"
        os.close(fd)
        reason = f"the file system refuses O_DIRECT reads ({refusal})"
    log.warning("O_DIRECT refused, using buffered reads (the page cache will hold expert bytes)",
                path=path, reason=reason)
    return os.open(path, flags), False, reason


def _direct_read_refused(fd: int) -> str | None:
    """Some file systems accept O_DIRECT at open and refuse it on read: try one aligned read."""
    page = mmap.mmap(-1, ALIGN)
    try:
        os.preadv(fd, [page], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return exc.strerror
        raise
    finally:
        page.close()
    return None
