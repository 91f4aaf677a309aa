"""Structured outputs: constrained decoding through llguidance (JSON schema, JSON object, regex, choice, grammar)."""

from orinfer.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
