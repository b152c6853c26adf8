"""Models by name: the registry of known models and their download (``parity pull``)."""
