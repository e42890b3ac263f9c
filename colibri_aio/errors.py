"""Exceptions the engine raises on purpose.

A :class:`UserError` is something the user can fix (a path, an option, a
broken or unsupported file): the CLI prints its message as one line on stderr
and exits with status 2. A :class:`NonFiniteError` is a broken model found
while computing (a NaN or infinity in a hidden state or the logits): also a
user error, naming the layer. An :class:`EngineBusyError` tells a caller that
asked not to wait that the engine is generating for someone else. An
:class:`ExpertReadError` is an I/O fault while streaming an expert: it names
the file, offset, length and (layer, expert), and it is raised instead of ever
handing compute wrong or partial bytes.
"""
from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix; reported as one line, exit status 2."""


MAX_LINE = 1000  # characters of one error line


def one_line(message: object) -> str:
    """``message`` as one printable line: whitespace runs (newlines included) become one space, other control
    characters their escapes, and a very long text is cut. The error path prints every message through it,
    so that no text from a model file can break the one-line rule or drive a terminal."""
    text = " ".join(str(message).split())
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


class ModelFormatError(UserError):
    """The GGUF is not one we can run: not a GGUF, truncated, inconsistent or unsupported."""


class NonFiniteError(ModelFormatError):
    """A hidden state or the logits stopped being finite: the model's weights are broken."""


class EngineBusyError(RuntimeError):
    """The engine is already generating and the caller asked not to wait (``wait=False``)."""


class ExpertReadError(OSError):
    """Reading one expert's bytes failed or came back short."""

    def __init__(self, path: str, offset: int, length: int, layer: int, expert: int, reason: str) -> None:
        self.path, self.offset, self.length = path, offset, length
        self.layer, self.expert, self.reason = layer, expert, reason
        super().__init__(
            f"{path}: reading {length} bytes at offset {offset} for layer {layer} expert {expert} failed: {reason}")
