"""Checkpoints: a training run's arrays and metadata in one pickle-free `.npz`, replaced
atomically, so a crash leaves either the old checkpoint or the new one, never half of one.

Layout: one member per array (its key as given, `KEY.npy`) plus `__meta__.npy`, the metadata as
UTF-8 JSON in a uint8 array.  `save_checkpoint` adds `format` (FORMAT_VERSION) and `writer`
("streamsched X.Y.Z"); the rest is the caller's.  What `streamsched run` writes (docs/data.md,
"Checkpoints", lists the same fields; a test holds the two equal)::

    format           2 (format 1, written before, is read too)
    writer           "streamsched 0.1.0": how `--save` recognises a file it may replace
    run              the id of the run that wrote it (its log lines carry the same id)
    saved_at         when, ISO 8601 with the UTC offset
    model            the model's name
    program          the first 16 hex digits of the sha256 of the program's text, includes too
    data             the data source, as resolved (`digits(test=0.2, seed=0)`, `npz(/abs/f.npz)`)
    seed             the shuffle seed (the order of epoch e is a function of (seed, e))
    epoch            the number of whole epochs trained (1-based: 3 after the third epoch)
    epochs           the run's planned length in epochs
    step             the number of steps trained, all runs of this checkpoint together
    steps_per_epoch  steps in one epoch (the training samples // the batch)
    lr               {"schedule": "cosine(v=0.1, warmup=50, min=0.0)", "total_steps": T, "resume": ...}
    layout           {name: [shape, dtype]} of every array, as the program declared it
    history          the per-epoch records, as in the log

Errors: X007 missing or unreadable checkpoint, or arrays that do not fit the run (check_arrays:
missing, unknown, or of another shape or dtype); X014 a checkpoint over the data limit; X008
(check_meta) a checkpoint whose metadata differs where the caller demands equality.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
import zipfile
from typing import Any

import numpy as np

from streamsched import __version__
from streamsched.auxnames import temp_pattern as _temp_pattern, temp_prefix, temp_suffix
from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.data import archive_kind
from streamsched.interp.ir import Span
from streamsched.reads import META_LIMIT, ReadError, data_limit, file_kind, human_size, limit_hint, read_npz

FORMAT_VERSION = 2
META_KEY = "__meta__"
WRITER = f"streamsched {__version__}"
_RESERVED = {META_KEY}


def program_hash(text: str) -> str:
    """sha256 of a .sched program's text, hex."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _err(code: str, message: str, span: Span | None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic(code, message, span=span, help=help)])


def temp_pattern(path: str) -> re.Pattern:
    """The names of the temporary files `atomic_temp` makes for `path` (outputs.temp_pattern:
    `.ck.npz.streamsched-k3j9x0_a.tmp`, and `.plan.svg.streamsched-k3j9x0_a.tmp.svg` for writers
    that need the suffix), so that a later run can remove the ones a killed run left behind."""
    return _temp_pattern(os.path.abspath(os.fspath(path)))


def atomic_temp(path: str, keep_suffix: bool = False) -> tuple[int, str]:
    """A new temporary file next to `path` (same folder, so `os.replace` is a rename), named
    `.NAME.streamsched-XXXXXXXX.tmp` (outputs.temp_prefix), with the
    permissions the final file should have (those of the file it replaces, else 0666 less the
    umask; mkstemp's own 0600 would make every output private).  keep_suffix: end the name in
    path's suffix too (`dot -Tsvg` and matplotlib choose the format by it).  Returns (fd, name).
    Raises OSError when path names a folder, or an existing file that is not a regular one, or
    its folder cannot be written."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):  # else the temporary file would land in the folder above it
            raise IsADirectoryError(errno.EISDIR, "is a folder, not a checkpoint file", path)
        raise OSError(errno.EEXIST, f"is {file_kind(st.st_mode)}, not a regular file; it is never replaced", path)
    directory = os.path.dirname(path)
    # the name never exceeds the folder's NAME_MAX (outputs.aux_base), and no output may have it
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=temp_suffix(path, keep_suffix), dir=directory)
    try:
        if st is not None:
            mode = stat.S_IMODE(st.st_mode)
        else:
            umask = os.umask(0o022)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
    except (OSError, AttributeError):  # pragma: no cover (no fchmod: Windows)
        pass
    return fd, tmp


def replace_atomically(tmp: str, path: str) -> None:
    """Rename the finished temporary file `tmp` over `path`, unless `path` became something
    other than a regular file meanwhile (then OSError, tmp removed); fsync the folder after."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        _unlink_quietly(tmp)
        raise OSError(errno.EEXIST, f"is {file_kind(st.st_mode)}, not a regular file; it is never replaced", path)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _unlink_quietly(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def save_checkpoint(path: str | os.PathLike, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write arrays and meta to path (an .npz) atomically.

    arrays: name -> numeric array (any shape and dtype but object); meta: JSON-serialisable
    dict (ints, floats, strings, lists, dicts; tuples come back as lists), to which `format` and
    `writer` are added.  Writes a temporary file in path's folder (atomic_temp), flushes and
    fsyncs it, `os.replace`s it over path, then fsyncs the folder so the rename itself is durable.
    On any failure (an interrupt included) the temporary file is removed and the previous
    checkpoint at path is untouched.  Raises OSError when path is a folder or an existing file
    that is not a regular one (a FIFO, a device, a symbolic link: never replaced), or its folder
    cannot be written (the caller turns it into a diagnostic); ValueError for a reserved or
    non-string key, an object array, or meta that JSON cannot hold (programming errors, not
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
    meta = {"format": FORMAT_VERSION, "writer": WRITER, **meta}
    try:
        text = json.dumps(meta, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint: meta is not plain JSON: {e}") from None
    clean[META_KEY] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    fd, tmp = atomic_temp(path)
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
        replace_atomically(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


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


def load_checkpoint(path: str | os.PathLike, span: Span | None = None, *,
                    limit: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read a checkpoint written by `save_checkpoint`: (name -> array, meta dict).

    Never unpickles, and reads only a regular file (never a FIFO or a device), its arrays at most
    `limit` bytes together (None: reads.data_limit()) and its metadata at most META_LIMIT, both
    checked before decompressing.  Raises StreamschedError X007 when the file is missing, is not
    a regular file or not an .npz, lacks or has unreadable `__meta__`, holds an object array or
    an array whose header disagrees with its bytes, or was written by a newer format version;
    X014 when it is over a limit.
    """
    path = os.fspath(path)
    help_ = "start without --resume, or point it at a checkpoint written by `streamsched run`"
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        what = "does not exist" if st is None else f"is {file_kind(st.st_mode)}, not a checkpoint file"
        raise _err("X007", f"checkpoint `{path}` {what}", span, help=help_)
    kind = archive_kind(path)
    if kind != "npz":
        what = "it holds a single .npy array" if kind == "npy" else kind
        raise _err("X007", f"checkpoint `{path}` is not an .npz archive ({what})", span, help=help_)
    try:
        lim = data_limit(limit)
    except ValueError as e:
        raise _err("X004", str(e), None, help="write a size such as 8G or 512M") from None
    try:
        names, arrays = read_npz(path, lim + META_LIMIT, None, {META_KEY: META_LIMIT})
    except ReadError as e:
        if e.why == "too_large" and e.member == META_KEY:
            raise _err("X014", f"checkpoint `{path}` {e.message}", span,
                       help=f"the metadata limit is fixed at {human_size(META_LIMIT)} (`--data-limit` is for arrays): "
                            "`streamsched run` writes a few KiB of it, so this file was not written by it or was "
                            "altered; point --resume at a checkpoint `streamsched run` wrote") from None
        if e.why == "too_large":
            hint = limit_hint((e.need or lim) - META_LIMIT if e.need else lim * 2)
            raise _err("X014", f"checkpoint `{path}` {e.message}", span,
                       help=f"raise the limit with `--data-limit {hint}` (or STREAMSCHED_DATA_LIMIT={hint}) if the "
                            "checkpoint really is that large") from None
        what = "it holds pickled (object) data, which streamsched never loads" if e.why == "pickle" else e.message
        raise _err("X007", f"checkpoint `{path}` is corrupt or unreadable: {what}", span, help=help_) from None
    raw = arrays.pop(META_KEY, None)
    if raw is None:
        raise _err("X007", f"checkpoint `{path}` is corrupt or unreadable: no `{META_KEY}` entry", span, help=help_)
    if sum(a.nbytes for a in arrays.values()) > lim:
        total = sum(a.nbytes for a in arrays.values())
        raise _err("X014", f"checkpoint `{path}` holds {human_size(total)} of arrays, over the {human_size(lim)} data "
                   "limit", span, help=f"raise the limit with `--data-limit {limit_hint(total)}` (or "
                                       f"STREAMSCHED_DATA_LIMIT={limit_hint(total)})")
    try:
        meta = json.loads(np.ascontiguousarray(raw).tobytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _err("X007", f"checkpoint `{path}` is corrupt or unreadable: its metadata is not JSON ({e})", span,
                   help=help_) from None
    if not isinstance(meta, dict):
        raise _err("X007", f"checkpoint `{path}` is corrupt: its metadata is not a JSON object", span, help=help_)
    fmt = meta.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt > FORMAT_VERSION:
        raise _err("X007", f"checkpoint `{path}` has format {fmt!r}; this streamsched reads format "
                   f"{FORMAT_VERSION} and older", span, help="resume with the streamsched version that wrote it")
    return arrays, meta


def checkpoint_meta(path: str) -> dict | None:
    """The metadata of the checkpoint `path` when streamsched wrote it, read without its arrays:
    a zip archive with a `__meta__` member holding a JSON object with `"writer": "streamsched
    ..."` (format 2), or with `format`, `model` and `program` (format 1); None otherwise."""
    if archive_kind(path) != "npz":
        return None
    try:
        names, arrays = read_npz(path, META_LIMIT, (META_KEY,), {META_KEY: META_LIMIT})
        meta = json.loads(np.ascontiguousarray(arrays[META_KEY]).tobytes().decode("utf-8"))
    except (ReadError, KeyError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if isinstance(meta, dict) and (str(meta.get("writer", "")).startswith("streamsched")
                                   or {"format", "model", "program"} <= set(meta)):
        return meta
    return None


def written_by_us(path: str) -> tuple[bool, str]:
    """Whether the regular file `path` is a checkpoint this tool wrote, told by its metadata
    alone (checkpoint_meta; the arrays are not read).  Returns (yes, what it is, as a phrase:
    for a checkpoint, whose: `a checkpoint of model `mlp` (epoch 40 of 40, run ..., saved ...)`)."""
    kind = archive_kind(path)
    if kind != "npz":
        return False, {"npy": "a single .npy array", "it is empty": "an empty file", "it holds text": "a text file",
                       }.get(kind, "a binary file")
    meta = checkpoint_meta(path)
    if meta is None:
        try:
            read_npz(path, META_LIMIT, (META_KEY,), {META_KEY: META_LIMIT})
            return False, "an .npz archive that is not a streamsched checkpoint"
        except ReadError:
            return False, "a zip archive that is not a streamsched checkpoint"
    bits = []
    if isinstance(meta.get("epoch"), int):
        bits.append(f"epoch {meta['epoch']}" + (f" of {meta['epochs']}" if isinstance(meta.get("epochs"), int) else ""))
    for key, word in (("run", "run"), ("saved_at", "saved")):
        if isinstance(meta.get(key), str):
            bits.append(f"{word} {meta[key]}")
    model = f" of model `{meta['model']}`" if isinstance(meta.get("model"), str) else ""
    return True, f"a checkpoint{model}" + (f" ({', '.join(bits)})" if bits else "")


def first_nonfinite(arrays: dict[str, np.ndarray]) -> tuple[str, tuple[int, ...], float] | None:
    """The first float array (in name order) holding NaN or an infinity: (name, index, value),
    or None when every value is finite."""
    for name in sorted(arrays):
        a = np.asarray(arrays[name])
        if a.dtype.kind not in "fc" or a.size == 0:
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~np.isfinite(a)
        if bad.any():
            idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad.reshape(-1))), a.shape))
            return name, idx, float(a[idx])
    return None


def check_finite_arrays(arrays: dict[str, np.ndarray], path: str, span: Span | None = None) -> None:
    """Refuse a checkpoint holding a value that is not finite (X007, naming the array and the
    first bad index): `streamsched run` never writes one (an epoch whose state is not finite has
    diverged), so it was altered or written elsewhere, and resuming from it would only report a
    divergence with the learning rate to blame."""
    bad = first_nonfinite(arrays)
    if bad is not None:
        name, idx, v = bad
        raise _err("X007", f"checkpoint `{path}` is corrupt: array `{name}` holds {v} at index "
                   f"[{', '.join(map(str, idx))}]; every value of a checkpoint is finite", span,
                   help="resume from an earlier checkpoint, or start without --resume; `streamsched run` never "
                        "writes a checkpoint of a state that is not finite")


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
