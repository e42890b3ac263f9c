"""The I/O layer: io_uring reactor, registered buffer pool, fallback readers.

``ExpertReader.open(paths, slot_nbytes_max, n_slots, backend)`` opens a model's
file (or the parts of a split model) for expert reads; ``reader.start(location, slot)`` submits one expert's
reads into pool slot ``slot`` and returns a future of zero-copy views of its
bytes. Which slot a read may use is the expert cache's decision (one
allocator); the reader only refuses a slot the kernel still owns.
"""
from colibri_aio.io.align import ALIGN, plan_expert, slot_nbytes_for
from colibri_aio.io.modelfile import ModelFileChangedError
from colibri_aio.io.pool import BufferPool
from colibri_aio.io.reader import BACKENDS, ExpertReader, ReaderClosedError, ReaderStats

__all__ = [
    "ALIGN", "BACKENDS", "BufferPool", "ExpertReader", "ModelFileChangedError", "ReaderClosedError", "ReaderStats",
    "plan_expert", "slot_nbytes_for",
]
