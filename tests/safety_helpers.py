"""Shared by the run-safety tests: a snapshot of a folder (every file's bytes and mode, every
link's target, every FIFO), so a test can assert that a command changed nothing but the run's own
checkpoint and log, and the in-process command runner that asserts no traceback."""

from __future__ import annotations

import os
import stat

from test_robustness import main, project, run_tiny  # noqa: F401  (re-exported)


def snapshot(root) -> dict[str, tuple]:
    """rel path -> ("file", bytes, mode) | ("link", target) | ("dir", mode) | ("other", kind)."""
    out: dict[str, tuple] = {}
    root = str(root)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[rel] = ("file", f.read(), stat.S_IMODE(st.st_mode))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode))
    return out


def assert_untouched(before: dict, root, own: tuple[str, ...] = ()) -> dict:
    """Every entry of `before` is byte-identical now, unless it is one of `own` (the run's own
    checkpoint and log, as paths relative to root); nothing new appeared but `own` (no stray
    temporary or lock file).  Returns the new snapshot."""
    after = snapshot(root)
    for rel, v in before.items():
        if rel in own:
            continue
        assert after.get(rel) == v, f"{rel} changed"
    new = set(after) - set(before) - set(own)
    assert not new, f"new files: {sorted(new)}"
    return after


def code_of(err: str) -> str:
    """The code of the first diagnostic in a command's stderr."""
    for line in err.splitlines():
        if line.startswith("error["):
            return line[6:10]
    return ""
