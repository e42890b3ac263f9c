"""Placement policy without I/O: the scheduler policy and the objects it drives (expert cache,
prefetch backpressure, lookahead bookkeeping), usage history and pins, and the trace replay
that chooses the defaults.

Every object here takes events and returns decisions; none of them reads a
file descriptor or needs an event loop, so they are tested against a fake disk
and a fake clock (design invariant 5). The engine's driver
(:mod:`colibri_aio.engine.scheduler`) feeds :class:`~colibri_aio.policy.scheduler.SchedulerPolicy`
and performs its actions with the I/O layer.
"""
