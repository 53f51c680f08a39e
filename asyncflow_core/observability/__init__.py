"""Observability: the tracer, its spans and counters, and the summaries and files it writes."""
