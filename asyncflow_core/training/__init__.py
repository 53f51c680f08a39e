"""Training math: RL losses and advantages, and the sampling settings that travel with tokens."""
