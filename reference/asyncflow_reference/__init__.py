"""Reference engines."""
