"""pytest plugin."""
