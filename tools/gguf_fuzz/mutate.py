"""Seeded mutations of a GGUF fixture: one seed, one mutant, the same bytes every time.

Blind mutations (bit flips, byte changes, truncations) find what nobody
thought of; aimed ones reach the fields a blind flip rarely hits in a useful
way: length and count fields set huge or off by one, value and tensor types
changed, tensor offsets swapped or moved, dimensions changed, bytes of the
tokenizer's tokens and merges and of the chat template changed, special-token
ids and hyper-parameters set out of range, and the chat template replaced by
a hostile one (the header is rebuilt around it, so the rest of the file stays
valid). One to four mutations are stacked per mutant.
"""
from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass

from gguf_fuzz.layout import Layout, Span

CHAT_TEMPLATE = "tokenizer.chat_template"

# Templates that try to escape the sandbox, never end, or render far too much.
HOSTILE_TEMPLATES = (
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ self.__init__.__globals__ }}",
    "{{ messages.__class__.__base__ }}",
    "{% import 'os' as os %}{{ os }}",
    "{% include '/etc/passwd' %}",
    "{% extends 'base.html' %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}0123456789abcdef{% endfor %}{% endfor %}",
    "{{ 'a' * 100000000000 }}",
    "{{ (messages * 1000000000) | length }}",
    "{{ 9 ** 9 ** 9 }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '{:>9999999999}'.format('x') }}",
    "{{ 'x' | center(10000000000) }}",
    "{{ 'x' | indent(10000000000, true) }}",
    "{{ range(10000000000) | list }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{{ 1 / 0 }}",
    "{{ raise_exception('this model refuses to chat') }}",
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}",
    "{{ messages[0]['content'] | int(10000000000) }}{{ undefined_name.attribute }}",
    "{{ strftime_now('%Y' * 100000) }}",
    "{% raw %}",
    "{{",
)
_TEMPLATE_BYTES = b"{}%#-+~|.()[]'\"\\ \n\x00\xff\xc3ab01"


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v % (1 << 64))


def _put(buf: bytearray, span: Span, value: int) -> None:
    buf[span.start: span.stop] = (value % (1 << (8 * span.size))).to_bytes(span.size, "little")


def _get(buf: bytearray, span: Span) -> int:
    return int.from_bytes(buf[span.start: span.stop], "little")


def _huge(rng: random.Random, old: int, room: int) -> int:
    """A length or count a parser must not trust: off by one, doubled, the file's size, or far beyond it."""
    return rng.choice([0, 1, old - 1, old + 1, old * 2, room, room + 1, 2**31 - 1, 2**32 - 1, 2**32,
                       2**32 + old, 2**40, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 1])


def _interesting(rng: random.Random, old: int, size: int) -> int:
    """A scalar value at an edge: zero, one, off by one, negative, huge, or a float NaN / infinity."""
    ints = [0, 1, 2, 3, old - 1, old + 1, old * 2, old * 1000, -1, 2**15, 2**31 - 1, 2**31, 2**32 - 1, 2**53,
            2**63 - 1, rng.getrandbits(8 * size)]
    floats = {4: [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff", b"\xff\xff\x7f\x7f",
                  struct.pack("<f", -1.0), struct.pack("<f", 1e-30)],
              8: [struct.pack("<d", x) for x in (math.nan, math.inf, -math.inf, 1e300, -1.0)]}
    if size in floats and rng.random() < 0.3:
        return int.from_bytes(rng.choice(floats[size]), "little")
    return rng.choice(ints)


def _pick(rng: random.Random, spans: list[Span]) -> Span | None:
    return rng.choice(spans) if spans else None


# Each mutation edits ``buf`` in place and says what it did; None when the fixture has nothing to aim at.
Mutation = Callable[[bytearray, Layout, random.Random], "str | None"]


def bit_flip(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    n = rng.randint(1, 8)
    for _ in range(n):
        i = rng.randrange(lay.header_end)
        buf[i] ^= 1 << rng.randrange(8)
    return f"{n} bit flips in the header"


def byte_set(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    n = rng.randint(1, 8)
    for _ in range(n):
        buf[rng.randrange(lay.header_end)] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
    return f"{n} header bytes changed"


def length_huge(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    s = _pick(rng, lay.where(kind=rng.choice(["slen", "acount", "key_len", "tname_len"])))
    if s is None:
        return None
    old = _get(buf, s)
    new = _huge(rng, old, lay.size - s.stop)
    _put(buf, s, new)
    return f"{s.kind} of {s.owner} {old} -> {new}"


def count_change(buf: bytearray, lay: Layout, rng: random.Random) -> str:
    s = rng.choice(lay.where(kind="count"))
    old = _get(buf, s)
    new = rng.choice([old - 1, old + 1, old + rng.randint(2, 50), 0, old * 2, 2**32, 2**40, 2**63, 2**64 - 1])
    _put(buf, s, new)
    return f"{s.owner} {old} -> {new}"


def type_change(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    kind = rng.choice(["vtype", "etype", "ggml_type"])
    s = _pick(rng, lay.where(kind=kind))
    if s is None:
        return None
    old = _get(buf, s)
    pool = range(42) if kind == "ggml_type" else range(14)
    new = rng.choice([*pool, 255, 2**16, 2**31, 2**32 - 1])
    _put(buf, s, new)
    return f"{kind} of {s.owner} {old} -> {new}"


def offset_swap(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    offsets = lay.where(kind="offset")
    if len(offsets) < 2:
        return None
    a, b = rng.sample(offsets, 2)
    va, vb = _get(buf, a), _get(buf, b)
    _put(buf, a, vb)
    _put(buf, b, va)
    return f"offsets of {a.owner} and {b.owner} swapped"


def offset_set(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    offsets = lay.where(kind="offset")
    if not offsets:
        return None
    s = rng.choice(offsets)
    old = _get(buf, s)
    other = _get(buf, rng.choice(offsets))
    new = rng.choice([0, old + 1, old + lay.alignment, old - lay.alignment, other, lay.size - lay.data_start,
                      lay.size, 2**40, 2**63, 2**64 - 1, 2**64 - lay.alignment])
    _put(buf, s, new)
    return f"offset of {s.owner} {old} -> {new}"


def dims(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    if rng.random() < 0.25:
        s = _pick(rng, lay.where(kind="n_dims"))
        if s is None:
            return None
        old = _get(buf, s)
        new = rng.choice([0, 1, 2, 3, 4, 5, 8, 9, 2**32 - 1])
    else:
        s = _pick(rng, lay.where(kind="dim"))
        if s is None:
            return None
        old = _get(buf, s)
        new = rng.choice([0, 1, old - 1, old + 1, old * 2, old // 2, 2**32, 2**40, 2**62, 2**63, 2**64 - 1])
    _put(buf, s, new)
    return f"{s.kind} of {s.owner} {old} -> {new}"


def _bytes_in(buf: bytearray, rng: random.Random, spans: list[Span], alphabet: bytes, what: str) -> str | None:
    spans = [s for s in spans if s.size]
    if not spans:
        return None
    n = rng.randint(1, 4)
    for _ in range(n):
        s = rng.choice(spans)
        buf[s.start + rng.randrange(s.size)] = rng.choice(alphabet) if rng.random() < 0.7 else rng.randrange(256)
    return f"{n} bytes of {what} changed"


def template_bytes(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    return _bytes_in(buf, rng, lay.where(kind="sbytes", owner=CHAT_TEMPLATE), _TEMPLATE_BYTES, "the chat template")


def tokens_bytes(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    return _bytes_in(buf, rng, lay.where(kind="sbytes", owner="tokenizer.ggml.tokens"), b" <|>aEG\xc4\xa0\x00\xff",
                     "tokens")


def merges_bytes(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    return _bytes_in(buf, rng, lay.where(kind="sbytes", owner="tokenizer.ggml.merges"), b"  aEtGq\xc4\xa0\x00",
                     "merges")


def tokenizer_strings(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    """tokenizer.ggml.model / .pre and general.architecture: names the loader dispatches on."""
    owner = rng.choice(["tokenizer.ggml.model", "tokenizer.ggml.pre", "general.architecture"])
    return _bytes_in(buf, rng, lay.where(kind="sbytes", owner=owner), b"glamqwen2\x00", owner)


def token_type(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    spans = lay.where(kind="scalar", owner="tokenizer.ggml.token_type")
    if not spans:
        return None
    n = rng.randint(1, 16)
    for _ in range(n):
        _put(buf, rng.choice(spans), rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 255, 2**31 - 1, 2**32 - 1]))
    return f"{n} token types changed"


def special_id(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    s = _pick(rng, [s for s in lay.where(kind="scalar") if s.owner.endswith("_token_id")])
    if s is None:
        return None
    n_tokens = len(lay.where(kind="slen", owner="tokenizer.ggml.tokens"))
    new = rng.choice([n_tokens, n_tokens + 1, n_tokens * 2, 2**31 - 1, 2**32 - 1, 2**31])
    _put(buf, s, new)
    return f"{s.owner} -> {new} (vocabulary {n_tokens})"


def scalar(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    spans = [s for s in lay.where(kind="scalar") if not s.owner.startswith("tokenizer.")]
    s = _pick(rng, spans)
    if s is None:
        return None
    old = _get(buf, s)
    new = _interesting(rng, old, s.size)
    _put(buf, s, new)
    return f"{s.owner} {old} -> {new}"


def data_flip(buf: bytearray, lay: Layout, rng: random.Random) -> str | None:
    if lay.size <= lay.data_start:
        return None
    n = rng.randint(1, 4)
    for _ in range(n):
        i = rng.randrange(lay.data_start, lay.size)
        buf[i] ^= rng.choice([0x7F, 0x80, 0xFF, 1 << rng.randrange(8)])
    return f"{n} bytes of tensor data changed"


# kind -> (mutation, weight)
IN_PLACE: dict[str, tuple[Mutation, int]] = {
    "bit_flip": (bit_flip, 12), "byte_set": (byte_set, 10), "length_huge": (length_huge, 10),
    "count_change": (count_change, 5), "type_change": (type_change, 8), "offset_swap": (offset_swap, 6),
    "offset_set": (offset_set, 5), "dims": (dims, 6), "template_bytes": (template_bytes, 6),
    "tokens_bytes": (tokens_bytes, 5), "merges_bytes": (merges_bytes, 5), "tokenizer_strings": (tokenizer_strings, 3),
    "token_type": (token_type, 4), "special_id": (special_id, 4), "scalar": (scalar, 8), "data_flip": (data_flip, 3),
}
# Mutations that change the file's length, applied after the in-place ones (their spans would move).
RESIZING = {"template_hostile": 6, "truncate": 8}


def _string_value(text: str) -> bytes:
    raw = text.encode("utf-8")
    return _u64(len(raw)) + raw


def replace_template(buf: bytearray, lay: Layout, template: str) -> bytearray:
    """The file with its chat template replaced (or added as the last key), header re-padded to the alignment."""
    spans = lay.where(owner=CHAT_TEMPLATE)
    slen = [s for s in spans if s.kind == "slen"]
    sbytes = [s for s in spans if s.kind == "sbytes"]
    if slen and sbytes:
        head = buf[: slen[0].start] + _string_value(template) + buf[sbytes[0].stop: lay.header_end]
    else:  # no template yet: a new key/value after the last one, and one more key in the count
        first_tensor = min((s.start for s in lay.where(kind="tname_len")), default=lay.header_end)
        kv = _string_value(CHAT_TEMPLATE) + struct.pack("<I", 8) + _string_value(template)
        head = buf[:first_tensor] + kv + buf[first_tensor: lay.header_end]
        head[16:24] = _u64(int.from_bytes(head[16:24], "little") + 1)
    pad = -len(head) % lay.alignment
    return bytearray(head + bytes(pad) + buf[lay.data_start:])


def truncate(buf: bytearray, lay: Layout, rng: random.Random) -> tuple[bytearray, str]:
    end = rng.randrange(lay.header_end) if rng.random() < 0.6 else rng.randrange(lay.data_start, max(lay.size, lay.data_start + 1))
    return buf[:end], f"cut at byte {end} of {lay.size}"


@dataclass(frozen=True, slots=True)
class Mutant:
    """A mutated file and what was done to it."""

    data: bytes
    kinds: tuple[str, ...]
    notes: tuple[str, ...]


def mutate(raw: bytes, lay: Layout, key: str) -> Mutant:
    """The mutant named ``key`` (e.g. "tiny_q8_0.gguf/17") of a fixture: same key, same bytes."""
    rng = random.Random(key)
    n = rng.choices([1, 2, 3, 4], weights=[70, 20, 6, 4])[0]
    names = [*IN_PLACE, *RESIZING]
    weights = [w for _, w in IN_PLACE.values()] + list(RESIZING.values())
    chosen = rng.choices(names, weights=weights, k=n)
    buf, kinds, notes = bytearray(raw), [], []
    for kind in sorted(chosen, key=lambda k: k in RESIZING):  # in-place first, while the spans hold
        if kind == "template_hostile":
            template = rng.choice(HOSTILE_TEMPLATES)
            buf, note = replace_template(buf, lay, template), f"chat template replaced by {template[:60]!r}"
        elif kind == "truncate":
            buf, note = truncate(buf, lay, rng)
        else:
            note = IN_PLACE[kind][0](buf, lay, rng)
            if note is None:  # nothing of that kind in this fixture: flip bits instead
                kind, note = "bit_flip", bit_flip(buf, lay, rng)
        kinds.append(kind)
        notes.append(note)
    return Mutant(bytes(buf), tuple(kinds), tuple(notes))
