"""The dialects the gateway speaks: one module per client API family."""
