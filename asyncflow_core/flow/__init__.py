"""The streaming engine: pipelines, staleness control, virtual clock, the RL job, agent loops."""
