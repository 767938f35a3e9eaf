"""Errors a user can cause. Each carries a one-line message fit for a CLI or an HTTP body."""


class Ds4poolError(Exception):
    """Base class: anything a user or client can trigger (never an internal bug)."""


class ModelLoadError(Ds4poolError):
    """The model directory is missing files, has corrupt files or an unsupported config."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture ds4pool cannot run."""


class DeviceError(Ds4poolError):
    """The requested device or dtype is not available here."""


class ContextLengthError(Ds4poolError):
    """A prompt (plus the tokens to generate) does not fit the model's context."""


class ChatTemplateError(Ds4poolError):
    """The chat template is missing or failed to render the given messages."""


class OutOfBlocksError(Ds4poolError):
    """The paged KV pool has no free blocks left for the request."""
