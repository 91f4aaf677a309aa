"""Fields that several `quantization_config` formats share, parsed and checked once."""

from __future__ import annotations

from typing import Any

from orinfer.errors import ConfigError


def group_size_field(raw: dict[str, Any], where: str, *keys: str, default: int = 128) -> int:
    """The group size under the first of `keys` present: a positive integer, or -1 (one group per row)."""
    group = next((raw[k] for k in keys if k in raw), default)
    if isinstance(group, bool) or not isinstance(group, int) or (group <= 0 and group != -1):
        raise ConfigError(f"{where}: group_size={group!r} must be a positive integer (or -1: one group)")
    return group


def module_list_field(raw: dict[str, Any], where: str) -> tuple[str, ...]:
    """modules_to_not_convert: a list of module names (null or absent: none)."""
    skip = raw.get("modules_to_not_convert") or ()
    if not isinstance(skip, (list, tuple)) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"{where}: modules_to_not_convert must be a list of module names")
    return tuple(skip)
