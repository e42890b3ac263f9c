"""Placement policy without I/O: the expert cache, prefetch backpressure, lookahead
bookkeeping, usage history and pins, and the trace replay that chooses the defaults.

Every object here takes events and returns decisions; none of them reads a
file descriptor or needs an event loop, so they are tested against a fake disk
(design invariant 5). The I/O layer and the engine feed them.
"""
