"""The I/O layer: io_uring reactor, registered buffer pool, fallback readers."""
