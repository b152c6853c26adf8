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


class InputError(ParityError, ValueError):
    """A step's inputs are out of range: a token id outside the vocabulary, a position outside
    the context. Checked before any backend sees them."""


class ConfigError(ParityError):
    """A configuration file, environment variable or argument has a bad value."""


class ModelError(ParityError):
    """A model cannot be found, fetched or verified: an unknown name, a failed pull, a bad
    checksum, an architecture parity does not build."""


class ModelFileError(ModelError):
    """A GGUF file is malformed, truncated, or uses something parity does not support."""


class TokenizerError(ParityError):
    """A model's tokenizer metadata is missing or unsupported, or text cannot be encoded."""


class ChatTemplateError(ParityError):
    """A chat template is missing, fails to render, or tried something the sandbox forbids."""


class ContextLengthError(ParityError):
    """A prompt, or a prompt plus the tokens asked for, does not fit the context length."""
