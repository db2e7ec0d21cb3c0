"""What every config section shares: strict sections, the error type, the cache folder."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict


def default_cache_dir() -> Path:
    """Where eaglenest caches what it builds (the tiny target, the CPU kernel): ``$EAGLENEST_CACHE`` or
    ``~/.cache/eaglenest``."""
    return Path(os.environ.get("EAGLENEST_CACHE", Path.home() / ".cache" / "eaglenest"))


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file, the key and the fix."""
