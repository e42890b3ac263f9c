"""Every environment variable the engine reads, in one place: its name, the values it takes, its default, and why.

No other module reads the environment. An engine's switches are one
:class:`Settings` object, read once when the engine (or a net, or a kernel
backend made on its own) is made: every variable validated at once, the
caller's values (CLI flags, API keywords) over the environment's, then
passed down to whatever the engine builds. A process that sets a variable
before opening an engine (a benchmark's A/B arm, a test) is heard; a value
outside a switch's choices is a :class:`~colibri_aio.errors.UserError`
naming the variable, so a mistyped A/B arm never measures the default under
another name. What belongs to the process rather than to an engine (where the
caches live, the server's API key, a child's environment) is read by
:func:`get` and the helpers below.

The ``ggml_*`` switches are the A/B arms of the ggml backend that are still
open or kept for a receipt; their defaults are the measured winners, the
first of each ``choices``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from colibri_aio.errors import UserError


@dataclass(frozen=True, slots=True)
class Switch:
    """One environment variable: its choices (None: any non-empty ``kind`` of value), default and meaning."""

    variable: str
    default: str | None
    choices: tuple[str, ...] | None
    doc: str
    kind: str = "text"


SWITCHES: dict[str, Switch] = {
    "kernels": Switch("COLIBRI_KERNELS", "auto", ("auto", "ggml", "numpy"),
                      "matrix kernels when --kernels / kernels= is not given"),
    "kernel_threads": Switch("COLIBRI_KERNEL_THREADS", "2", None,
                             "threads of every kernel call (the caller plus n - 1 pool workers)", "a count >= 1"),
    "trunk_huge_pages": Switch("COLIBRI_TRUNK_HUGE_PAGES", "on", ("on", "off"),
                               "the resident trunk asks for transparent huge pages (decode x1.044, "
                               "evidence/decode_20261202T034250Z.md)"),
    "api_key": Switch("COLIBRI_API_KEY", None, None, "serve: the bearer token clients must send", "a key"),
    "cache_home": Switch("XDG_CACHE_HOME", None, None,
                         "where the engine's caches live (colibri_aio/ under it; ~/.cache without it)", "a folder"),
    # ggml's A/B arms (kernels/ggml_cpu.py says what each measured).
    "ggml_graphs": Switch("COLIBRI_GGML_GRAPHS", "on", ("on", "off"), "decode on whole ggml graphs"),
    "ggml_experts": Switch("COLIBRI_GGML_EXPERTS", "stacked", ("stacked", "each"),
                           "a layer's experts as one ggml_mul_mat_id stack, or one product each"),
    "ggml_attention": Switch("COLIBRI_GGML_ATTENTION", "f32", ("f32", "f16"), "decode attention's precision"),
    "ggml_expert_gemm": Switch("COLIBRI_GGML_EXPERT_GEMM", "1", ("1", "0"),
                               "experts of several rows on llamafile's GEMM"),
    "ggml_expert_cells": Switch("COLIBRI_GGML_EXPERT_CELLS", "batch", ("batch", "rows"),
                                "a batched step's experts over all its rows in one product, or row by row"),
    "ggml_prefill": Switch("COLIBRI_GGML_PREFILL", "graphs", ("graphs", "ops"),
                           "a prompt's positions together on graphs block by block, or per operation"),
    "ggml_step": Switch("COLIBRI_GGML_STEP", "graph", ("graph", "layers"),
                        "a resident decode step as one graph, or two graphs a block"),
    "ggml_repack": Switch("COLIBRI_GGML_REPACK", "on", ("on", "off"),
                          "resident matrices copied into ggml's CPU_REPACK layout at load"),
    "ggml_repack_experts": Switch("COLIBRI_GGML_REPACK_EXPERTS", "auto", ("auto", "off", "on", "all"),
                                  "routed experts in ggml's CPU_REPACK layout: read from a repack file when one "
                                  "exists (auto), never, or also repacked as they land (on: Q4_0/IQ4_NL/MXFP4; all: "
                                  "Q4_K/Q2_K too)"),
}


def _checked(switch: Switch, value: str | None) -> str | None:
    if switch.choices is not None and value not in switch.choices:
        raise UserError(f"{switch.variable}={value!r}: choose one of {', '.join(switch.choices)}")
    return value


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of switch ``name`` now (its default when unset or empty); UserError if it is not a choice."""
    switch = SWITCHES[name]
    return _checked(switch, (os.environ if environ is None else environ).get(switch.variable) or switch.default)


def given(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Switch ``name``'s variable as the environment holds it: None when unset, ``""`` when set empty (which
    :func:`get` reads as unset; a caller that must not take an empty value for none tells them apart here)."""
    return (os.environ if environ is None else environ).get(SWITCHES[name].variable)


def _thread_count(text: str | None) -> int:
    try:
        count = int(text or "")
    except ValueError:
        count = 0
    if count < 1:
        raise UserError(f"COLIBRI_KERNEL_THREADS={text!r}: a whole number of threads >= 1")
    return count


@dataclass(frozen=True, slots=True)
class Settings:
    """Every switch of :data:`SWITCHES` for one engine, read once and validated (module docstring)."""

    values: Mapping[str, str | None]

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None, **overrides: str | None) -> Settings:
        """The environment's values (``environ``, default this process's), ``overrides`` (short names, None:
        not given) over them; UserError naming the first variable out of its choices."""
        unknown = set(overrides) - set(SWITCHES)
        if unknown:
            raise ValueError(f"unknown settings {sorted(unknown)}")
        env = os.environ if environ is None else environ
        values = {name: _checked(switch, overrides.get(name) or env.get(switch.variable) or switch.default)
                  for name, switch in SWITCHES.items()}
        _thread_count(values["kernel_threads"])
        return cls(values)

    def get(self, name: str) -> str | None:
        """Switch ``name``'s value."""
        return self.values[name]

    def on(self, name: str) -> bool:
        """An on/off switch's state."""
        return self.values[name] == "on"

    @property
    def kernel_threads(self) -> int:
        """``COLIBRI_KERNEL_THREADS`` as a count >= 1."""
        return _thread_count(self.values["kernel_threads"])


def cache_home() -> str:
    """``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return get("cache_home") or os.path.join(os.path.expanduser("~"), ".cache")


def child_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child process, with ``extra`` set over it."""
    return {**os.environ, **(extra or {})}


def describe() -> list[str]:
    """One line per switch: variable, choices, default, meaning (for ``--help`` texts and the README)."""
    lines = []
    for switch in SWITCHES.values():
        takes = "|".join(switch.choices) if switch.choices else switch.kind
        lines.append(f"{switch.variable} ({takes}; default {switch.default or 'unset'}): {switch.doc}")
    return lines
