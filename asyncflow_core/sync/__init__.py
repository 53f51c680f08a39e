"""Weight sync: moving a trainer's weights into rollout engines (transports and strategies)."""
