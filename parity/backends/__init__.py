"""Built-in backends. Each registers through the same hooks an outside plugin uses."""
