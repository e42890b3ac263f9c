"""The I/O layer: io_uring reactor, registered buffer pool, fallback readers.

``ExpertReader.open(path, slot_nbytes_max, n_slots, backend)`` opens a model
file for expert reads; ``await reader.read(location)`` returns a
:class:`SlotLease` whose ``weights`` are zero-copy views of the expert's bytes.
:class:`StreamingExpertSource` adapts a reader to the engine's ExpertSource.
"""
from colibri_aio.io.align import ALIGN, plan_expert, slot_nbytes_for
from colibri_aio.io.modelfile import ModelFileChangedError
from colibri_aio.io.pool import BufferPool, SlotState
from colibri_aio.io.reader import BACKENDS, ExpertReader, ReaderClosedError, ReaderStats, SlotLease
from colibri_aio.io.source import ExpertStream, StreamingExpertSource

__all__ = [
    "ALIGN", "BACKENDS", "BufferPool", "ExpertReader", "ExpertStream", "ModelFileChangedError",
    "ReaderClosedError", "ReaderStats", "SlotLease", "SlotState", "StreamingExpertSource",
    "plan_expert", "slot_nbytes_for",
]
