"""What can go wrong finding or building a model folder (typed, so callers tell the cases apart)."""


class ModelError(Exception):
    """Base class for model-folder errors."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The embedded model's wheel/GGUF or a named local folder is missing."""


class UnsupportedModelError(ModelError, ValueError):
    """The model spec is neither the embedded model nor a local folder (no hub downloads)."""


class ModelConversionError(ModelError, RuntimeError):
    """Converting the GGUF (or writing a model folder) produced something unusable."""


class ModelConfigError(ModelError, ValueError):
    """Invalid arguments for a generated model."""


class HubModelUnavailableError(ModelError, RuntimeError):
    """A hub id that cannot be served from here (not cached while offline, hub unreachable, unknown)."""
