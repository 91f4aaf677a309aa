"""Exceptions raised for bad input. Each message names the file, field or value at fault, so a user sees the cause
without a traceback from deep inside the engine. All derive from ValueError so callers can catch them together."""


class OrinferError(ValueError):
    """Base class of every user-facing error."""


class ConfigError(OrinferError):
    """A config.json (or an engine option) that orinfer cannot run: missing, malformed or unsupported."""


class WeightsError(OrinferError):
    """Model weights that are missing, corrupt, or do not match the config (name or shape)."""


class RequestError(OrinferError):
    """A request that cannot be served: empty or too long prompt, invalid sampling value, context overflow."""
