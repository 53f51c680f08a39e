"""The machine: devices and process groups, the HTTP client, checkpoint files and failpoints."""
