"""The exceptions parity raises on purpose. Each message says what is wrong and what to do."""


class ParityError(Exception):
    """Base of every error parity raises deliberately."""


class GraphError(ParityError):
    """A graph is malformed: bad sources, shapes, dtypes or leaf layout."""


class SchedulingError(ParityError):
    """No backend can run a node, or ``strict`` forbade a fallback."""


class BackendError(ParityError):
    """A backend is unavailable, misused, or failed to run."""


class PluginError(ParityError):
    """A plugin failed to load or register, or speaks an incompatible plugin API."""


class ConfigError(ParityError):
    """A configuration file, environment variable or argument has a bad value."""
