"""The names streamsched keeps next to an output: its lock (`.NAME.streamsched-lock`) and its
temporary files (`.NAME.streamsched-XXXXXXXX.tmp`), shortened to fit the folder's NAME_MAX.  A
leaf module (nothing of streamsched imported): outputs.py and the checkpoint writer both use it."""

from __future__ import annotations

import hashlib
import os
import re

LOCK_SUFFIX = ".streamsched-lock"
TEMP_INFIX = ".streamsched-"




def _name_max(folder: str) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def aux_base(full: str) -> str:
    """The part of the lock and temporary names that stands for the output `full`: its own name,
    or, when `.NAME.streamsched-XXXXXXXX.tmp.EXT` would exceed the folder's NAME_MAX, the name's
    start and 8 hex digits of its sha256 (`verylongname~1a2b3c4d`), so that every name the
    folder allows has a lock and temporary file that fit."""
    base = os.path.basename(full)
    ext = os.path.splitext(base)[1]
    size = lambda t: len(os.fsencode(t))  # NAME_MAX counts bytes  # noqa: E731
    room = _name_max(os.path.dirname(full) or ".") - (1 + len(TEMP_INFIX) + 8 + len(".tmp") + min(size(ext), 16))
    if size(base) <= room:
        return base
    digest = hashlib.sha256(os.fsencode(base)).hexdigest()[:8]
    cut = base[:max(1, room - 9)]
    while size(cut) > room - 9 and len(cut) > 1:
        cut = cut[:-1]
    return cut + "~" + digest


def lock_path(full: str) -> str:
    """Where the lock of output `full` lives: `.NAME.streamsched-lock` in its folder."""
    return os.path.join(os.path.dirname(full), f".{aux_base(full)}{LOCK_SUFFIX}")


def temp_prefix(full: str) -> str:
    """The start of the temporary files' names for output `full` (tempfile adds 8 characters and
    `.tmp`, and the output's suffix for writers that choose the format by it)."""
    return f".{aux_base(full)}{TEMP_INFIX}"


def temp_suffix(full: str, keep_suffix: bool) -> str:
    ext = os.path.splitext(os.path.basename(full))[1]
    return ".tmp" + (ext if keep_suffix and len(os.fsencode(ext)) <= 16 else "")


def temp_pattern(full: str) -> re.Pattern:
    """The names of the temporary files made for `full` (`.ck.npz.streamsched-k3j9x0_a.tmp`, and
    `.plan.svg.streamsched-k3j9x0_a.tmp.svg`), so that a later run can remove the ones a killed
    run left behind, and nothing else."""
    ext = os.path.splitext(os.path.basename(full))[1]
    return re.compile("^" + re.escape(temp_prefix(full)) + r"[A-Za-z0-9_]{8}\.tmp(" + re.escape(ext) + ")?$", re.DOTALL)
