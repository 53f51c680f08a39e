"""The streaming data store: samplers, the metadata controller, the in-process store, waiters."""
