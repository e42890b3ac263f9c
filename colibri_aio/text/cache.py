"""The tokenizer, built once per model and kept in a cache file keyed by the model's fingerprint.

Building the BPE of a 152k-token vocabulary from the GGUF's tokens and
merges takes over a second; reading the built pipeline back from its JSON
form takes about a quarter of that. The file:
``$XDG_CACHE_HOME/colibri_aio/tokenizer/<fingerprint>.json``, a first line of
JSON about it (format, version, fingerprint, the ``tokenizers`` version that
wrote it, the SHA-256 of the rest) and then the ``tokenizers`` JSON itself.

Like the usage history it is a cache: missing, it is built and written;
unreadable, damaged (checksum, JSON, a pipeline ``tokenizers`` refuses) or
another model's, it is moved aside to ``<name>.bad`` with one warning and
built again; a place that cannot be written costs one warning, never the run.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer as HFTokenizer

from colibri_aio.cachefiles import cache_dir, set_aside, write_atomic
from colibri_aio.gguf.fingerprint import model_fingerprint
from colibri_aio.gguf.model import Model
from colibri_aio.logs import get_logger
from colibri_aio.text.tokenizer import Tokenizer, TokenizerSpec, build_hf_tokenizer

log = get_logger("colibri_aio.tokenizer")

CACHE_FORMAT, CACHE_VERSION = "colibri-aio-tokenizer", 1


class DamagedEntry(Exception):
    """A cache file that cannot be used; the message says why."""


def cache_path(fingerprint: str) -> Path:
    return cache_dir("tokenizer", f"{fingerprint}.json")


def _encode(fingerprint: str, hf: HFTokenizer) -> bytes:
    body = hf.to_str().encode("utf-8")
    head = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "fingerprint": fingerprint,
            "tokenizers": tokenizers.__version__, "sha256": hashlib.sha256(body).hexdigest()}
    return json.dumps(head).encode("utf-8") + b"\n" + body


def _decode(data: bytes, fingerprint: str, spec: TokenizerSpec) -> HFTokenizer:
    """The pipeline a cache file holds; :class:`DamagedEntry` for anything wrong with it."""
    first, _, body = data.partition(b"\n")
    try:
        head = json.loads(first.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise DamagedEntry("its first line is not JSON") from None
    if not isinstance(head, dict) or head.get("format") != CACHE_FORMAT or head.get("version") != CACHE_VERSION:
        raise DamagedEntry(f"not a {CACHE_FORMAT} file of version {CACHE_VERSION}")
    if head.get("fingerprint") != fingerprint:
        raise DamagedEntry("it belongs to another model")
    if head.get("sha256") != hashlib.sha256(body).hexdigest():
        raise DamagedEntry("its checksum does not match (truncated or damaged)")
    try:
        hf = HFTokenizer.from_str(body.decode("utf-8"))
    except Exception as exc:  # the library raises bare Exceptions for a pipeline it cannot read
        raise DamagedEntry(f"tokenizers {tokenizers.__version__} cannot read it ({exc})") from None
    if hf.get_vocab_size(with_added_tokens=True) != len(spec.tokens):
        raise DamagedEntry(f"it has {hf.get_vocab_size(with_added_tokens=True)} tokens, the model {len(spec.tokens)}")
    return hf


def load_tokenizer(model: Model, cache: bool = True) -> tuple[Tokenizer, str]:
    """The model's tokenizer and where it came from ("cache", "built", or "built, cached");
    raises ModelFormatError for a missing or unsupported tokenizer, whatever the cache holds."""
    if not cache:
        return Tokenizer.from_gguf(model.reader), "built"
    fingerprint = model_fingerprint(model)
    path = cache_path(fingerprint)
    source = "built"

    def pipeline(spec: TokenizerSpec) -> HFTokenizer:
        nonlocal source
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            data = None
        except OSError as exc:
            log.warning(f"{path}: cannot read the cached tokenizer ({exc.strerror or exc}); building it")
            return build_hf_tokenizer(spec)
        if data is not None:
            try:
                hf = _decode(data, fingerprint, spec)
                source = "cache"
                return hf
            except DamagedEntry as exc:
                _set_aside(path, str(exc))
        hf = build_hf_tokenizer(spec)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, _encode(fingerprint, hf))
        except OSError as exc:
            log.warning(f"tokenizer not cached ({exc.filename or path.parent}: {exc.strerror or exc}); the next run "
                        f"builds it again")
            return hf
        source = "built, cached"
        return hf

    return Tokenizer.from_gguf(model.reader, pipeline), source


def _set_aside(path: Path, problem: str) -> None:
    try:
        aside = set_aside(path)
    except OSError as exc:
        log.warning(f"{path}: cached tokenizer unusable ({problem}) and cannot be moved aside "
                    f"({exc.strerror or exc}); building it")
        return
    log.warning(f"{path}: cached tokenizer unusable ({problem}); moved it to {aside.name}, building it again")
