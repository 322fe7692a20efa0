"""Checkpoints: a training run's arrays and metadata in one pickle-free `.npz`, replaced
atomically, so a crash leaves either the old checkpoint or the new one, never half of one.

Layout: one member per array (its key as given) plus `__meta__`, the metadata as UTF-8 JSON in a
uint8 array.  The metadata a run writes (`streamsched run`)::

    format        FORMAT_VERSION (added when absent)
    model         the model's name
    epoch, step   where to resume: epoch e, step k within it (Batches.epoch(e, start=k))
    seed          the shuffle seed (plain int; the order of epoch e is a function of (seed, e))
    lr_step       the global step the learning-rate schedule resumes from
    program       program_hash(text of the .sched file); resuming with another program is refused

Errors: X007 missing or unreadable checkpoint, or arrays that do not fit the run (check_arrays:
missing, unknown, or of another shape or dtype); X008 checkpoint does not match the run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
import zipfile
import zlib
from typing import Any

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.data import archive_kind, own_words
from streamsched.interp.ir import Span

FORMAT_VERSION = 1
META_KEY = "__meta__"
_RESERVED = {META_KEY}


def program_hash(text: str) -> str:
    """sha256 of a .sched program's text, hex; what `meta["program"]` holds."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _err(code: str, message: str, span: Span | None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic(code, message, span=span, help=help)])


def save_checkpoint(path: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write arrays and meta to path (an .npz) atomically.

    arrays: name -> numeric array (any shape and dtype but object); meta: JSON-serialisable
    dict (ints, floats, strings, lists, dicts; tuples come back as lists).  Writes a temporary
    file in path's folder, flushes and fsyncs it, `os.replace`s it over path, then fsyncs the
    folder so the rename itself is durable.  On any failure the temporary file is removed and the
    previous checkpoint at path is untouched.  Raises OSError when path is a folder or its
    folder cannot be written (the caller turns it into a diagnostic), ValueError for a reserved
    or non-string key, an object array, or meta that JSON cannot hold (programming errors, not
    user mistakes).
    """
    path = os.fspath(path)
    clean: dict[str, np.ndarray] = {}
    for key, arr in arrays.items():
        if not isinstance(key, str) or key in _RESERVED:
            raise ValueError(f"checkpoint: array key {key!r} is not allowed (reserved: {sorted(_RESERVED)})")
        arr = np.asarray(arr)
        if arr.dtype.hasobject:
            raise ValueError(f"checkpoint: array {key!r} has dtype {arr.dtype}; checkpoints hold no pickles")
        clean[key] = arr
    meta = {"format": FORMAT_VERSION, **meta}
    try:
        text = json.dumps(meta, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint: meta is not plain JSON: {e}") from None
    clean[META_KEY] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    if os.path.isdir(path):  # else the temporary file would land in the folder above it
        raise IsADirectoryError(errno.EISDIR, "is a folder, not a checkpoint file", path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            # np.savez's layout (one NAME.npy per array, stored), written member by member so
            # that any buffer name is a key (np.savez(**arrays) reserves `file`, `allow_pickle`)
            with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
                for key, arr in clean.items():
                    with zf.open(key + ".npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, arr, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    """Make a rename in directory durable; a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, span: Span | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a checkpoint written by `save_checkpoint`: (name -> array, meta dict).

    Never unpickles (np.load with allow_pickle=False).  Raises StreamschedError X007 when the
    file is missing, is not an .npz, lacks or has unreadable `__meta__`, holds an object array,
    or was written by a newer format version.
    """
    path = os.fspath(path)
    help_ = "start without --resume, or point it at a checkpoint written by `streamsched run`"
    if not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "does not exist"
        raise _err("X007", f"checkpoint `{path}` {what}", span, help=help_)
    kind = archive_kind(path)
    if kind != "npz":
        what = "it holds a single .npy array" if kind == "npy" else kind
        raise _err("X007", f"checkpoint `{path}` is not an .npz archive ({what})", span, help=help_)
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an .npz archive")
        with z:
            if META_KEY not in z.files:
                raise ValueError(f"no `{META_KEY}` entry")
            arrays = {k: z[k] for k in z.files if k != META_KEY}
            meta = json.loads(z[META_KEY].tobytes().decode("utf-8"))
    except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error, UnicodeDecodeError) as e:
        raise _err("X007", f"checkpoint `{path}` is corrupt or unreadable: {own_words(e)}", span,
                   help=help_) from None
    if not isinstance(meta, dict):
        raise _err("X007", f"checkpoint `{path}` is corrupt: its metadata is not a JSON object", span, help=help_)
    fmt = meta.get("format")
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise _err("X007", f"checkpoint `{path}` has format {fmt!r}; this streamsched reads format "
                   f"{FORMAT_VERSION} and older", span, help="resume with the streamsched version that wrote it")
    return arrays, meta


_FIELD_HELP = {
    "program": "the .sched program changed since this checkpoint was written; resume with the same "
    "program, or start a fresh run",
    "model": "the checkpoint belongs to another model; point --resume at this model's checkpoint",
}


def check_meta(meta: dict[str, Any], expected: dict[str, Any], span: Span | None = None) -> None:
    """Refuse to resume from a checkpoint that belongs to another run.

    Every key of expected must be in meta with an equal value (compared after a JSON round trip,
    so tuples equal lists).  Raises StreamschedError with one X008 per mismatching field, each
    naming the field and both values.
    """
    diags = []
    for key, want in expected.items():
        want = json.loads(json.dumps(want))
        if key not in meta:
            diags.append(Diagnostic("X008", f"checkpoint has no `{key}`; this run expects {want!r}", span=span,
                                    help="the checkpoint was written by another version or tool; start a fresh run"))
        elif meta[key] != want:
            shown = (lambda v: f"{v[:12]}..." if isinstance(v, str) and len(v) > 16 else repr(v))
            diags.append(Diagnostic("X008", f"checkpoint does not match this run: `{key}` is {shown(meta[key])} "
                                    f"in the checkpoint, {shown(want)} here", span=span,
                                    help=_FIELD_HELP.get(key, "resume with the settings the checkpoint was written "
                                                         "with, or start a fresh run")))
    if diags:
        raise StreamschedError(diags)


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_arrays(arrays: dict[str, np.ndarray], expected: dict[str, tuple[tuple[int, ...], np.dtype | None]],
                 path: str, span: Span | None = None) -> None:
    """Refuse a checkpoint whose arrays do not fit the run, before any of them is written into
    its buffers: every name of `expected` (name -> (shape, dtype); dtype None: not compared) must
    be in `arrays` with exactly that shape and dtype (no broadcasting, no casting), and `arrays`
    must hold nothing else.  Raises StreamschedError with one X007 per array of the wrong shape
    or dtype (naming it, expected vs found), one for the missing names and one for the unknown
    ones."""
    diags = []
    help_ = ("the checkpoint was not written by `streamsched run` for this program, or was altered; "
             "start without --resume, or point it at a checkpoint this program wrote")

    def fmt(shape, dtype) -> str:
        return f"shape {tuple(int(d) for d in shape)}" + (f", dtype {np.dtype(dtype).name}" if dtype is not None else "")

    for name, (shape, dtype) in expected.items():
        if name not in arrays:
            continue
        a = arrays[name]
        if tuple(a.shape) != tuple(shape) or (dtype is not None and a.dtype != np.dtype(dtype)):
            diags.append(Diagnostic("X007", f"checkpoint `{path}`: array `{name}` does not fit this run: expected "
                                    f"{fmt(shape, dtype)}, found {fmt(a.shape, a.dtype if dtype is not None else None)}",
                                    span=span, help=help_))
    missing = [n for n in expected if n not in arrays]
    if missing:
        diags.append(Diagnostic("X007", f"checkpoint `{path}` lacks {len(missing)} array{'s' if len(missing) != 1 else ''} "
                                f"this run needs: {_names(missing)}", span=span,
                                help=help_ + " (a missing array would silently start from its initial value)"))
    unknown = sorted(n for n in arrays if n not in expected)
    if unknown:
        diags.append(Diagnostic("X007", f"checkpoint `{path}` holds {len(unknown)} array{'s' if len(unknown) != 1 else ''} "
                                f"this run does not have: {_names(unknown)}", span=span, help=help_))
    if diags:
        raise StreamschedError(diags)
