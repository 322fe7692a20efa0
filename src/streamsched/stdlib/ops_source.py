"""The stdlib's `.sched` text and the name its spans carry: a leaf module (nothing of streamsched
imported), so both the loader and the diagnostics renderer can read it without importing each
other."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

STDLIB_PATH = "<stdlib>/ops.sched"
"""The file name of the stdlib's spans (it is not a path on disk)."""


@lru_cache(maxsize=1)
def stdlib_text() -> str:
    """The text of `stdlib/ops.sched`, read once per process."""
    return resources.files("streamsched.stdlib").joinpath("ops.sched").read_text(encoding="utf-8")
