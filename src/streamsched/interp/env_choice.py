"""An environment variable that takes one of a few words: what the CUDA backend's settings
(STREAMSCHED_GEMM_TUNE, STREAMSCHED_PRIORITIES, STREAMSCHED_SKINNY_GEMM) share.  Case and
surrounding spaces are ignored; unset, empty and each alias read as a word; any other value is
refused, by `streamsched run` and `train()` before any work with X004 (training/settings.py,
`env_choices`), and here with ValueError.  Imports nothing of streamsched: any layer may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EnvChoice:
    """name: the variable; words: what it may say (the first listed in messages first);
    default: the word when unset or empty; aliases: other spellings -> their word."""

    name: str
    words: tuple[str, ...]
    default: str
    aliases: dict = field(default_factory=dict)

    def error(self, value: str | None) -> str:
        """Why `value` is not one of the words, or '' when it is (None: unset)."""
        if value is None or value.strip().lower() in self.words + tuple(self.aliases) + ("",):
            return ""
        return f"`{value}` is not {', '.join(self.words[:-1])} or {self.words[-1]}"

    def get(self) -> str:
        """The variable's word now; ValueError for a value that is not one."""
        v = os.environ.get(self.name)
        why = self.error(v)
        if why:
            raise ValueError(f"${self.name}: {why}")
        v = (v or "").strip().lower()
        return self.aliases.get(v, v) or self.default

    def help(self) -> str:
        """A fix for a refused value, e.g. "unset it, or set NAME=1 (the default), all or 0"."""
        words = [w + (" (the default)" if w == self.default else "") for w in self.words]
        return f"unset it, or set {self.name}={', '.join(words[:-1])} or {words[-1]}"
