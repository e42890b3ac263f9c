"""Benchmarks and their receipts, shipped beside the runtime but never imported by it.

Installed as ``colibri_aio.bench`` (like ``colibri_aio.io`` and
``colibri_aio.kernels``, it lives at the top of the source tree) so that the
``iobench`` command works from an installed wheel; the engine, its policy and
its I/O layer never import it. ``receipt`` is what every benchmark receipt in
``evidence/`` starts with (host, commit, command, n/median/min/max) and how it
is written; the tools in ``tools/`` use the same module. ``iobench`` measures
expert-sized reads through each I/O backend beside fio; ``locations`` makes
expert locations over any file, for benchmarks and tests that need no model;
``lock`` holds the shared machine's CPU lock exclusively around each timed run.
"""
