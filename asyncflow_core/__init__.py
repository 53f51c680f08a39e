"""AsyncFlow core."""
