"""The engine kit: engine helpers, engines in child processes, LM training, engine registry."""
