"""The usage history on disk: a cache file, and one that never blocks a run.

Where it lives: ``$XDG_CACHE_HOME/colibri_aio/usage/<fingerprint>.json``
(``~/.cache/...`` without XDG). Not next to the model: model directories are
often read-only or shared between users, and keying by fingerprint already
finds the history wherever the model is.

It behaves like a cache (what it holds is in :mod:`colibri_aio.policy.usage`):

- missing: the run starts a new one;
- unreadable, damaged (not UTF-8, not JSON, values out of range) or foreign
  (another format version, another model's fingerprint): moved aside to
  ``<name>.bad`` with one warning, and the run starts a new one; if it cannot
  even be moved, this run leaves the file alone;
- a location that cannot be written (read-only, a file where a folder should
  be): one warning at the end, and the run's use is not recorded;
- concurrent runs: :meth:`HistoryFile.save` locks the folder, reads the file
  again, folds this run's counts into what it holds now and replaces it
  atomically, so no run's counts are lost; the lock is waited for at most
  ``LOCK_TIMEOUT`` seconds.

A history file the user names (``--pin FILE``) is not a cache: it is read
strictly by :func:`read_history`, and anything wrong with it is a
:class:`~colibri_aio.errors.UserError`.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from colibri_aio.cachefiles import cache_dir, set_aside, write_atomic
from colibri_aio.errors import UserError
from colibri_aio.gguf.model import Model
from colibri_aio.logs import get_logger
from colibri_aio.policy.usage import UsageHistory, model_fingerprint

log = get_logger("colibri_aio.history")

LOCK_TIMEOUT = 5.0
_LOCK_POLL = 0.05


def default_usage_path(fingerprint: str) -> Path:
    """Where the history of the model with ``fingerprint`` is kept."""
    return cache_dir("usage", f"{fingerprint}.json")


def parse_history(data: bytes, fingerprint: str, source: str) -> UsageHistory:
    """A history from a file's bytes; anything wrong with them is a :class:`UserError`."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise UserError(f"{source}: usage history is not valid JSON (truncated or damaged)") from None
    return UsageHistory.from_json(doc, fingerprint, source)


def read_history(path: str | os.PathLike[str], fingerprint: str) -> UsageHistory:
    """A history file the user named: missing, unreadable, damaged or foreign is a :class:`UserError`."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such usage history") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read usage history ({exc.strerror or exc})") from None
    return parse_history(data, fingerprint, str(path))


@contextlib.contextmanager
def _folder_lock(folder: Path, timeout: float) -> Iterator[None]:
    """An exclusive flock on the folder itself (no lock file to leave behind); TimeoutError after ``timeout``."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{folder} stayed locked for {timeout:g} s") from None
                time.sleep(_LOCK_POLL)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


class HistoryFile:
    """One model's usage history at its default place, read and written as a cache."""

    def __init__(self, path: Path, fingerprint: str, block_count: int, expert_count: int) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.shape = (block_count, expert_count)
        self.left_alone = False  # a warning said why this run does not touch the file any more

    @classmethod
    def for_model(cls, model: Model, path: Path | None = None) -> "HistoryFile":
        fingerprint = model_fingerprint(model)
        return cls(path or default_usage_path(fingerprint), fingerprint, model.args.block_count,
                   model.args.expert_count)

    def empty(self) -> UsageHistory:
        return UsageHistory(self.fingerprint, *self.shape)

    def load(self) -> UsageHistory:
        """What the file holds, or an empty history; never raises (a bad file is set aside with a warning)."""
        if self.left_alone:
            return self.empty()
        try:
            data = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return self.empty()
        except OSError as exc:
            self._set_aside(f"{self.path}: cannot read usage history ({exc.strerror or exc})")
            return self.empty()
        try:
            history = parse_history(data, self.fingerprint, str(self.path))
        except UserError as exc:
            self._set_aside(str(exc))
            return self.empty()
        if history.counts.shape != self.shape:
            self._set_aside(f"{self.path}: usage history has counts of shape {history.counts.shape}, "
                            f"the model {self.shape}")
            return self.empty()
        return history

    def save(self, run: UsageHistory) -> bool:
        """Fold one run's counts into the file under the folder lock; never raises (one warning instead)."""
        if self.left_alone or not run.counts.any():
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _folder_lock(self.path.parent, LOCK_TIMEOUT):
                write_atomic(self.path, json.dumps(self.load().with_run(run).to_json()).encode("utf-8"))
            return True
        except TimeoutError as exc:
            reason = str(exc)
        except OSError as exc:
            reason = f"{exc.filename or self.path.parent}: {exc.strerror or exc}"
        log.warning(f"usage history not saved ({reason}); this run's expert use is not recorded "
                    f"(--no-history turns the history off)")
        return False

    def _set_aside(self, problem: str) -> None:
        """``problem`` (a message naming the file) goes out as one warning, with what was done about it."""
        try:
            aside = set_aside(self.path)
        except OSError as exc:
            self.left_alone = True
            log.warning(f"{problem}; it cannot be moved aside ({exc.strerror or exc}), so this run neither "
                        f"reads nor writes it")
            return
        log.warning(f"{problem}; moved it to {aside.name}, a new usage history starts")
