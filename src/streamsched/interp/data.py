"""Training data for the `train` block: `data = SOURCE(...)` becomes a `Dataset` of host arrays,
checked against the model's inputs and cut into fixed-shape, deterministically shuffled batches.

Sources (LANGUAGE.md, the `train` block)::

    digits(test = 0.2, seed = 0)   scikit-learn's bundled 8x8 digits, 1797 samples, stratified split
    idx("path/to/dir")             MNIST-format IDX files (train-/t10k- images and labels, .gz or not)
    npz("file.npz")                keys x_train, y_train, x_test, y_test; never unpickled
    text("PATH or GLOB", context = T, test = 0.1, seed = 0)
                                   byte-level tokens of UTF-8 text files, next-token windows;
                                   text("<python-stdlib>") is the top-level .py files of
                                   Python's standard library, a corpus every machine has

Every user mistake is a `StreamschedError` with an X code (docs/data.md): X001 unknown source,
X002 missing file (or one that is not a regular file), X003 corrupt file or values that are not
finite in f32, X004 bad argument, X005 data does not fit the model, X006 batch size does not fit
the data, X014 data over the data limit (reads.py: bounded before anything is decompressed).
Nothing here imports CuPy.
"""

from __future__ import annotations

import difflib
import glob
import gzip
import math
import os
import stat
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.ir import Span
from streamsched.reads import (ReadError, data_limit, file_kind, human_size, limit_hint, open_regular, read_exactly,
                               read_head, read_npz, read_regular)

SOURCES = ("digits", "idx", "npz", "text")
"""The data sources `load_dataset` knows, in the order the error message lists them."""

REQUIRED = object()
"""Marks a parameter of `bind_args` that has no default."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held in host memory; the arrays are read-only.

    x_train: f32 [N, *features], y_train: i32 [N] with values in [0, num_classes);
    x_test: f32 [M, *features], y_test: i32 [M].  name says where it came from
    (`digits(test=0.2, seed=0)`, `idx(/abs/dir)`, `npz(/abs/file.npz)`).

    A `text` data set (kind "text") holds token windows instead: x_train, y_train u8
    [N, context] are read-only sliding-window views of the training bytes (row i: bytes i ..
    i+context-1 and the next byte of each, so nothing is copied), x_test, y_test u8 [M, context]
    the test bytes cut into consecutive windows; epoch_samples (the windows of one epoch, drawn
    from the N) is one pass over the training bytes, (bytes - 1) // context.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str
    kind: str = "classes"
    epoch_samples: int | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample, without the leading sample dimension."""
        return tuple(self.x_train.shape[1:])


def _err(code: str, message: str, span: Span | None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic(code, message, span=span, help=help)])


def _did_you_mean(word: str, known) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"did you mean `{close[0]}`? " if close else ""


# ---------------------------------------------------------------------------------------------
# Arguments of call-like settings (shared with lr.py)


def bind_args(
    what: str,
    params: tuple[tuple[str, Any], ...],
    args: tuple,
    kwargs: dict,
    span: Span | None = None,
) -> dict[str, Any]:
    """Bind the arguments of a call-like setting such as `cosine(0.1, warmup = 50)` to its
    parameters, the way Python binds a call: positionals in order, then keywords.

    params: (name, default) pairs in positional order; default `REQUIRED` means no default.
    Returns name -> value for every parameter.  Raises StreamschedError X004 (too many
    positionals, an unknown or repeated keyword, a missing required argument), pointing at span.
    """
    names = [p for p, _ in params]
    sig = f"{what}({', '.join(names)})"
    if len(args) > len(params):
        raise _err(
            "X004",
            f"`{what}` takes at most {len(params)} positional argument{'s' if len(params) != 1 else ''}, "
            f"got {len(args)}",
            span,
            help=f"the signature is `{sig}`",
        )
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise _err(
                "X004",
                f"`{what}` has no argument `{key}`",
                span,
                help=f"{_did_you_mean(key, names)}the signature is `{sig}`",
            )
        if key in bound:
            raise _err(
                "X004",
                f"`{what}` got argument `{key}` twice (by position and by name)",
                span,
                help=f"the signature is `{sig}`",
            )
        bound[key] = value
    for name, default in params:
        if name not in bound:
            if default is REQUIRED:
                raise _err("X004", f"`{what}` needs argument `{name}`", span, help=f"the signature is `{sig}`")
            bound[name] = default
    return bound


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
    return _is_int(v) or (isinstance(v, (float, np.floating)) and np.isfinite(v))


# ---------------------------------------------------------------------------------------------
# Sources


def load_dataset(source: str, args: tuple, kwargs: dict, *, base_dir: str, span: Span | None = None,
                 limit: int | None = None, sample_shape: tuple[int, ...] | None = None) -> Dataset:
    """Load `source(*args, **kwargs)` from the `train` block's `data = ...` line.

    source: "digits" | "idx" | "npz"; args/kwargs: the literal arguments as parsed (numbers,
    strings); base_dir: the .sched file's folder, against which relative paths resolve;
    span: the `data = ...` line, put on every diagnostic; limit: the most bytes the data files may
    hold, decompressed, all arrays together (None: reads.data_limit(), 4 GiB unless
    $STREAMSCHED_DATA_LIMIT says otherwise); sample_shape: the model input's shape per sample,
    where `text` takes its context when the call does not give one.
    Returns a `Dataset` (x f32 [N, *features] in [0, 1] for digits and idx, y i32 [N]).
    Raises StreamschedError X001 unknown source, X002 missing file or folder (or one that is not a
    regular file), X003 corrupt or unreadable file, or values that are not finite numbers in f32
    (NaN, inf, or an f64 beyond f32's range: the file, the array and the first bad index are
    named), X004 bad argument, X014 data over the limit.
    """
    a = check_source(source, args, kwargs, base_dir=base_dir, span=span)
    try:
        budget = _Budget(data_limit(limit))
    except ValueError as e:
        raise _err("X004", str(e), None, help="write a size such as 8G or 512M") from None
    if source == "digits":
        return _load_digits(a["test"], a["seed"], span)
    if source == "idx":
        return _load_idx_dir(a["path"], span, budget)
    if source == "text":
        return _load_text(a, span, budget, sample_shape)
    return _load_npz(a["path"], span, budget)


class _Budget:
    """The bytes a data set may still read (reads.data_limit), spent file by file."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    @property
    def left(self) -> int:
        return self.limit - self.used

    def too_large(self, what: str, nbytes: int, span: Span | None) -> StreamschedError:
        so_far = f" after {human_size(self.used)} of earlier files" if self.used else ""
        hint = limit_hint(self.used + nbytes)
        return _err("X014", f"{what} holds {human_size(nbytes)} (decompressed), over the {human_size(self.limit)} "
                    f"data limit{so_far}", span,
                    help=f"raise the limit with `--data-limit {hint}` (or STREAMSCHED_DATA_LIMIT={hint}) if the data "
                         "really is that large")


def data_paths(source: str, args: tuple, kwargs: dict, *, base_dir: str) -> list[str]:
    """The files `data = source(...)` reads (absolute paths; an idx folder's four files, .gz or
    not, whichever exist), for the output checks that refuse to overwrite them.  A source that
    does not check gives [] (its own diagnostic comes when the data is loaded)."""
    try:
        a = check_source(source, args, kwargs, base_dir=base_dir)
    except StreamschedError:
        return []
    if source == "npz":
        return [a["path"]]
    if source == "text":
        return list(a["files"])
    if source == "idx":
        return [os.path.join(a["path"], base + gz) for names in _IDX_FILES.values() for base in names
                for gz in ("", ".gz") if os.path.lexists(os.path.join(a["path"], base + gz))]
    return []


DIGITS_SAMPLES = 1797
"""The samples of the `digits` source (scikit-learn's copy of the UCI optical digits)."""


def digits_train_samples(test: float) -> int:
    """How many training samples `digits(test = t)` holds: train_test_split's rule, the test
    split takes ceil(t * n) samples (stratification does not change the counts).  ValueError
    unless 0 < t < 1 (`check_source` reports that as X004)."""
    t = float(test)
    if not 0.0 < t < 1.0:
        raise ValueError(f"digits: test fraction {test!r} is not strictly between 0 and 1")
    return DIGITS_SAMPLES - math.ceil(t * DIGITS_SAMPLES)


def check_source(source: str, args: tuple, kwargs: dict, *, base_dir: str, span: Span | None = None) -> dict:
    """Everything about `data = source(...)` that can be told without reading data: the source
    is known (X001), its arguments bind and are in range (X004), and its file or folder exists
    and is of the right kind (X002).  Used by `load_dataset` and by `streamsched check`, so both
    refuse the same values with the same diagnostics.  Returns the bound arguments, a path
    argument resolved against base_dir."""
    if source == "digits":
        a = bind_args("digits", (("test", 0.2), ("seed", 0)), args, kwargs, span)
        _check_digits_args(a["test"], a["seed"], span)
        return a
    if source in ("idx", "npz"):  # idx reads a folder, npz a file
        a = bind_args(source, (("path", REQUIRED),), args, kwargs, span)
        path = _resolve_path(source, a["path"], base_dir, span)
        kind = "folder" if source == "idx" else "file"
        try:
            st = os.stat(path)
        except OSError:
            st = None
        ok = st is not None and (stat.S_ISDIR(st.st_mode) if source == "idx" else stat.S_ISREG(st.st_mode))
        if not ok:
            if st is None:
                what = "does not exist"
            elif source == "npz" and not stat.S_ISDIR(st.st_mode):
                what = f"is {file_kind(st.st_mode)}, not a regular file"
            else:
                what = f"is {'a file' if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)}, not a {kind}"
            raise _err("X002", f"{source}: data {kind} `{path}` {what}", span,
                       help="relative paths are resolved against the folder of the .sched file that writes them")
        return {**a, "path": path}
    if source == "text":
        return _check_text(args, kwargs, base_dir, span)
    raise _err(
        "X001",
        f"unknown data source `{source}`",
        span,
        help=f"{_did_you_mean(source, SOURCES)}known sources: "
        'digits(test = 0.2, seed = 0), idx("path/to/mnist"), npz("file.npz"), '
        'text("corpus/*.txt", context = 128)',
    )


def _resolve_path(what: str, path, base_dir: str, span: Span | None) -> str:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise _err("X004", f"`{what}` needs a path string, got {path!r}", span, help=f'write `{what}("path")`')
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    return os.path.abspath(path)


def _check_digits_args(test, seed, span: Span | None) -> None:
    if not _is_number(test) or not 0.0 < float(test) < 1.0:
        raise _err(
            "X004",
            f"digits: test fraction must be a number strictly between 0 and 1, got {test!r}",
            span,
            help="write e.g. `digits(test = 0.2)` to hold out 20% of the samples",
        )
    if not _is_int(seed) or seed < 0:
        raise _err("X004", f"digits: seed must be a non-negative integer, got {seed!r}", span,
                   help="write e.g. `digits(seed = 0)`")
    n_train = digits_train_samples(test)
    n_test = DIGITS_SAMPLES - n_train
    if min(n_train, n_test) < 10:  # a stratified split needs every class on both sides
        side, k = ("train", n_train) if n_train < n_test else ("test", n_test)
        raise _err("X004", f"digits: cannot split with test = {test}: the {side} split would hold {k} "
                   f"sample{'s' if k != 1 else ''}, fewer than the 10 classes", span,
                   help="use a test fraction that leaves at least 10 samples on each side")


def _load_digits(test, seed, span: Span | None) -> Dataset:
    """scikit-learn's copy of the UCI optical digits test set (1797 8x8 images, values 0..16)."""
    _check_digits_args(test, seed, span)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    try:
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=float(test), random_state=int(seed), stratify=y
        )
    except ValueError as e:  # a split too small to hold every class on both sides
        raise _err("X004", f"digits: cannot split with test = {test}: {e}", span,
                   help="use a test fraction that leaves at least 10 samples on each side") from None
    return _make_dataset(x_tr, y_tr, x_te, y_te, f"digits(test={float(test)}, seed={int(seed)})", span, "digits")


# IDX (http://yann.lecun.com/exdb/mnist/): magic = 0x00 0x00 <type> <ndim>, then ndim big-endian
# uint32 sizes, then the data, big-endian, row-major.
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_FILES = {
    "x_train": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "y_train": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "x_test": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "y_test": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}


def parse_idx(raw: bytes, name: str = "<bytes>", span: Span | None = None) -> np.ndarray:
    """Decode the bytes of one IDX file into an array of its stored shape and (native) dtype.

    Raises StreamschedError X003 on a bad magic number, an unknown type code, or a data size
    that does not match the header (truncated or with trailing bytes).
    """
    help_ = "re-download the file; an IDX file starts with 00 00 <type> <ndim>, e.g. 00 00 08 03 for images"
    if len(raw) < 4:
        raise _err("X003", f"`{name}` is not an IDX file: {len(raw)} bytes, too short for a header", span, help=help_)
    if raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES or raw[3] == 0:
        raise _err("X003", f"`{name}` is not an IDX file: bad magic number 0x{raw[:4].hex()}", span, help=help_)
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise _err("X003", f"`{name}` is truncated: the header names {ndim} dimensions but the file "
                   f"has {len(raw)} bytes", span, help=help_)
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    got = len(raw) - header
    if got != expected:
        what = "truncated" if got < expected else "longer than its header says"
        raise _err("X003", f"`{name}` is {what}: shape {shape} needs {expected} data bytes, found {got}",
                   span, help=help_)
    try:
        return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))
    except ValueError as e:  # an empty shape whose other dimensions NumPy cannot index: (0, 3e9, 3e9)
        raise _err("X003", f"`{name}` has a shape NumPy cannot hold, {shape}: {e}", span, help=help_) from None


def _read_idx(directory: str, key: str, span: Span | None, budget: _Budget) -> np.ndarray:
    for base in _IDX_FILES[key]:
        for path in (os.path.join(directory, base), os.path.join(directory, base + ".gz")):
            if os.path.lexists(path):
                return parse_idx(_idx_bytes(path, span, budget), path, span)
    names = ", ".join(f"{n}[.gz]" for n in _IDX_FILES[key])
    raise _err("X002", f"idx: `{directory}` has no {_IDX_FILES[key][0]} (or .gz)", span,
               help=f"an MNIST-format folder holds four files; looked for {names}")


def _idx_bytes(path: str, span: Span | None, budget: _Budget) -> bytes:
    """The bytes of one IDX file (decompressed when it ends in .gz), read only as far as its
    header says: the size the header claims is checked against the data limit before the data
    is read or decompressed (a gzip bomb stops at the header), and a file that continues past
    its data is refused without reading the rest."""
    try:
        fd = open_regular(path)
    except ReadError as e:
        code = "X002" if e.why in ("missing", "not_regular") else "X003"
        raise _err(code, f"idx: `{path}` {e.message}", span, help="an MNIST-format folder holds four regular files") from None
    try:
        with os.fdopen(fd, "rb") as f:
            stream = gzip.GzipFile(fileobj=f, mode="rb") if path.endswith(".gz") else f
            if stream is f and os.fstat(fd).st_size > budget.left:
                raise budget.too_large(f"idx: `{path}`", os.fstat(fd).st_size, span)
            head = read_exactly(stream, 4)
            if len(head) < 4 or head[0] or head[1] or head[2] not in _IDX_TYPES or head[3] == 0:
                return head  # parse_idx says what is wrong
            dims = read_exactly(stream, 4 * head[3])
            if len(dims) < 4 * head[3]:
                return head + dims
            count = 1
            for d in np.frombuffer(dims, dtype=">u4"):
                count *= int(d)
            expected = count * np.dtype(_IDX_TYPES[head[2]]).itemsize
            if expected > budget.left:
                raise budget.too_large(f"idx: `{path}` (shape {tuple(int(d) for d in np.frombuffer(dims, '>u4'))})",
                                       expected, span)
            data = read_exactly(stream, expected + 1)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise _err("X003", f"cannot read `{path}`: {e}", span,
                   help="re-download the file; a .gz file must be a complete gzip stream") from None
    if len(data) > expected:
        raise _err("X003", f"`{path}` is longer than its header says: shape "
                   f"{tuple(int(d) for d in np.frombuffer(dims, '>u4'))} needs {expected} data bytes, found more",
                   span, help="re-download the file; an IDX file holds exactly the data its header describes")
    budget.used += len(data)
    return head + dims + data


def _load_idx_dir(directory: str, span: Span | None, budget: _Budget | None = None) -> Dataset:
    """An MNIST-format folder, already checked to exist by check_source."""
    budget = budget or _Budget(data_limit())
    a = {key: _read_idx(directory, key, span, budget) for key in _IDX_FILES}
    for key in ("x_train", "x_test"):
        if a[key].ndim < 2:
            raise _err("X003", f"idx: {_IDX_FILES[key][0]} has shape {a[key].shape}; images need at least "
                       "2 dimensions (samples, pixels...)", span)
        if len(a[key]) == 0:  # (an empty split cannot be flattened by its sample count)
            split = "training" if key == "x_train" else "test"
            raise _err("X003", f"idx: `{_IDX_FILES[key][0]}` in `{directory}` holds no samples (shape "
                       f"{a[key].shape}): the {split} split is empty", span,
                       help="every run trains on the training split and is evaluated on the test split each "
                            "epoch; both need at least one sample")
        check_finite(a[key], f"idx: `{_IDX_FILES[key][0]}` in `{directory}`", span)
        # Pixels stored as bytes are scaled to [0, 1]; other types are taken as they are.
        scale = 255.0 if a[key].dtype == np.uint8 else 1.0
        a[key] = (a[key].reshape(len(a[key]), -1) / scale).astype(np.float32)
    return _make_dataset(a["x_train"], a["y_train"], a["x_test"], a["y_test"], f"idx({directory})", span, "idx")


_F32_MAX = float(np.finfo(np.float32).max)
F32_SQRT_MAX = math.sqrt(_F32_MAX)
"""1.84e19: a feature beyond it has a square beyond f32's range, so the products and sums of
squares of training (a linear layer's weight gradient, a norm, a variance, Adam's second moment)
overflow on it whatever the learning rate."""


def check_finite(x: np.ndarray, what: str, span: Span | None) -> None:
    """Refuse features that training cannot take in f32, its dtype: NaN, inf, a wider float
    beyond +-3.4e38 (it would become inf), or any value (float or integer) beyond +-1.84e19
    (F32_SQRT_MAX), whose square overflows f32 (a feature of 1e30 makes a finite loss of 1e29:
    bad data that would otherwise be reported as a learning rate that diverges).  what names the
    array and its file ("npz: `x_train` in `/d/data.npz`").  Raises StreamschedError X003 naming
    the first bad index (row-major) and its value."""
    if x.dtype.kind not in "fiu" or x.size == 0:
        return
    if x.dtype.kind == "f":
        bad = ~np.isfinite(x)
        with np.errstate(invalid="ignore", over="ignore"):
            bad |= np.abs(x) > F32_SQRT_MAX
    elif x.dtype.itemsize < 8:  # an int32 or narrower cannot reach 1.84e19
        return
    else:
        bad = np.abs(x.astype(np.float64)) > F32_SQRT_MAX
    if not bad.any():
        return
    idx = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad.reshape(-1))), x.shape))
    v = float(x[idx])
    if not math.isfinite(v):
        why = ""
    elif abs(v) > _F32_MAX:
        why = f", beyond f32's range (+-{_F32_MAX:.6g}): it would be inf in training"
    else:
        why = (f", beyond +-{F32_SQRT_MAX:.3g}: its square is beyond f32's range (+-{_F32_MAX:.3g}), so training "
               "overflows on it whatever the learning rate")
    n_bad = int(bad.sum())
    raise _err("X003", f"{what} holds {v:.6g} at index [{', '.join(map(str, idx))}] (sample {idx[0]}){why}; "
               f"{n_bad} value{'s are' if n_bad != 1 else ' is'} not a finite f32 number of at most {F32_SQRT_MAX:.3g} "
               "in all", span,
               help="clean the data (every feature must be a finite number, in practice scaled to about [-1, 1] or "
                    "[0, 1]), e.g. with np.nan_to_num or by dropping those samples, then save it again")


def archive_kind(path: str) -> str:
    """What a file's first bytes say it is: "npz" (a zip archive, as np.savez writes), "npy"
    (one array, np.save), or what anything else is, as a phrase ("it is empty", "it holds text",
    "it is some other binary file").  Only a regular file is opened (never a FIFO or a device);
    read errors are left to the caller's reader."""
    try:
        head = read_head(path, 512)
    except ReadError:
        return "npz"  # let the reader report it
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "npz"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if not head:
        return "it is empty"
    try:
        head.decode("utf-8")
        return "it holds text"
    except UnicodeDecodeError:
        return "it is some other binary file"


def own_words(e: BaseException) -> str:
    """An exception from a reader in our words (reads.numpy_words): numpy's advice to load a file
    unsafely (`allow_pickle=`) is never the fix here, since streamsched never unpickles."""
    from streamsched.reads import numpy_words

    return numpy_words(e)


NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _load_npz(path: str, span: Span | None, budget: _Budget | None = None) -> Dataset:
    """An .npz archive, already checked to be a regular file by check_source; read with
    reads.read_npz (bounded, never unpickled)."""
    budget = budget or _Budget(data_limit())
    bad_file = "the file must be written by np.savez or np.savez_compressed"
    kind = archive_kind(path)
    if kind == "npy":
        raise _err("X003", f"npz: `{path}` holds a single array, not an .npz archive", span,
                   help="save with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)")
    if kind != "npz":
        # np.load would take it for a pickle and suggest allow_pickle; streamsched never unpickles.
        raise _err("X003", f"npz: `{path}` is not an .npz archive ({kind})", span, help=bad_file)
    try:
        names, a = read_npz(path, budget.left, NPZ_KEYS)
    except ReadError as e:
        if e.why == "too_large":
            hint = limit_hint(budget.used + (e.need or 2 * budget.left))
            raise _err("X014", f"npz: `{path}` {e.message}", span,
                       help=f"raise the limit with `--data-limit {hint}` (or STREAMSCHED_DATA_LIMIT={hint}) if the "
                            "data really is that large") from None
        if e.why in ("missing", "not_regular"):
            raise _err("X002", f"npz: data file `{path}` {e.message}", span) from None
        if e.why == "pickle":
            key = next((k for k in NPZ_KEYS if f"`{k}`" in e.message), "an array")
            raise _err("X003", f"npz: `{key}` in `{path}` is an object (pickled) array; streamsched never "
                       "unpickles data", span,
                       help="store plain numeric arrays: x as float, y as integer class indices") from None
        raise _err("X003", f"npz: `{path}` {e.message}", span, help=bad_file) from None
    missing = [k for k in NPZ_KEYS if k not in a]
    if missing:
        raise _err("X003", f"npz: `{path}` lacks key{'s' if len(missing) > 1 else ''} "
                   f"{', '.join(missing)} (it has: {', '.join(names) or 'nothing'})", span,
                   help="the archive needs x_train, y_train, x_test, y_test")
    budget.used += sum(v.nbytes for v in a.values())
    for k in ("x_train", "x_test"):
        if a[k].dtype.kind not in "biuf" or a[k].ndim < 2:
            raise _err("X003", f"npz: `{k}` must be a numeric array [samples, features...], got "
                       f"{a[k].dtype} with shape {a[k].shape}", span)
        check_finite(a[k], f"npz: `{k}` in `{path}`", span)
        a[k] = a[k].astype(np.float32)
    return _make_dataset(a["x_train"], a["y_train"], a["x_test"], a["y_test"], f"npz({path})", span, "npz")


def _make_dataset(x_tr, y_tr, x_te, y_te, name: str, span: Span | None, what: str) -> Dataset:
    """Check the split's consistency, convert labels to i32, freeze the arrays."""
    if x_tr.shape[1:] != x_te.shape[1:]:
        raise _err("X003", f"{what}: train samples have shape {x_tr.shape[1:]} but test samples "
                   f"{x_te.shape[1:]}", span)
    ys = {}
    for key, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        if y.dtype.kind not in "iu":
            raise _err("X003", f"{what}: {key} labels are {y.dtype}, not integers", span,
                       help="labels must be integer class indices 0..C-1 (e.g. np.int32)")
        if y.ndim != 1 or len(y) != len(x):
            raise _err("X003", f"{what}: {len(x)} {key} samples but labels of shape {y.shape}", span,
                       help="labels must be one integer per sample")
        if len(y) and (y.min() < 0 or y.max() > np.iinfo(np.int32).max):
            raise _err("X003", f"{what}: {key} labels range over [{y.min()}, {y.max()}]; class indices "
                       "must be non-negative", span)
        ys[key] = y.astype(np.int32)
    if len(x_tr) == 0:
        raise _err("X003", f"{what}: the training set is empty", span)
    if len(x_te) == 0:
        raise _err("X003", f"{what}: no test samples (the test split is empty)", span,
                   help="every run is evaluated on the test split each epoch; give x_test and y_test at "
                        "least one sample")
    num_classes = int(max(ys["train"].max(), ys["test"].max() if len(ys["test"]) else 0)) + 1
    arrays = [np.ascontiguousarray(a) for a in (x_tr, ys["train"], x_te, ys["test"])]
    for arr in arrays:
        arr.setflags(write=False)
    return Dataset(*arrays, num_classes=num_classes, name=name)


# ---------------------------------------------------------------------------------------------
# Text: byte-level tokens (vocabulary 256) of UTF-8 files, next-token windows


def python_stdlib_files() -> list[str]:
    """The top-level `.py` files of the running Python's standard library (the folder
    `sysconfig.get_paths()["stdlib"]`, about 4.7 MB in CPython 3.12), sorted by name: the corpus
    `text("<python-stdlib>")` reads, one every machine that runs streamsched has."""
    d = sysconfig.get_paths()["stdlib"]
    try:
        names = os.listdir(d)
    except OSError:
        return []
    return sorted(os.path.join(d, n) for n in names
                  if n.endswith(".py") and os.path.isfile(os.path.join(d, n)))


CORPORA = {"<python-stdlib>": python_stdlib_files}
"""Built-in corpora of `text("<NAME>")`: name -> the function listing their files."""

_GLOB_CHARS = frozenset("*?[")


def _text_files(path, base_dir: str, span: Span | None) -> tuple[list[str], str]:
    """(the files `text(path)` reads, in the order they are concatenated before any shuffle, and
    how the path is shown): a built-in corpus `<NAME>`, a glob pattern (regular files it matches,
    sorted; folders skipped), or one file.  X002 when nothing is there, X004 for an unknown
    corpus or a path that is not a string."""
    if isinstance(path, str) and path.startswith("<") and path.endswith(">"):
        if path not in CORPORA:
            raise _err("X004", f"text: unknown corpus `{path}`", span,
                       help=f"{_did_you_mean(path, CORPORA)}built-in corpora: {', '.join(CORPORA)}; "
                            'or give a file or a pattern, e.g. text("corpus/*.txt")')
        files = CORPORA[path]()
        if not files:
            raise _err("X002", f"text: corpus `{path}` has no files here (looked in "
                       f"`{sysconfig.get_paths()['stdlib']}`)", span,
                       help='give your own text files, e.g. text("corpus/*.txt")')
        return files, path
    full = _resolve_path("text", path, base_dir, span)
    if _GLOB_CHARS & set(os.fspath(path)):
        found = []
        for p in sorted(glob.glob(full, recursive=True)):
            try:
                st = os.stat(p)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                continue  # `corpus/*` may match folders; only files are text
            if not stat.S_ISREG(st.st_mode):
                raise _err("X002", f"text: `{p}` (matched by `{full}`) is {file_kind(st.st_mode)}, not a "
                           "regular file", span, help="narrow the pattern to regular files, e.g. `*.txt`")
            found.append(os.path.abspath(p))
        if not found:
            raise _err("X002", f"text: no file matches `{full}`", span,
                       help="relative patterns are resolved against the folder of the .sched file that writes them")
        return found, full
    try:
        st = os.stat(full)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        what = "does not exist" if st is None else f"is {file_kind(st.st_mode)}, not a regular file"
        hint = (f'to read every file of a folder, write a pattern: text("{os.path.join(os.fspath(path), "*.txt")}")'
                if st is not None and stat.S_ISDIR(st.st_mode) else
                "relative paths are resolved against the folder of the .sched file that writes them")
        raise _err("X002", f"text: data file `{full}` {what}", span, help=hint)
    return [full], full


def _check_text(args: tuple, kwargs: dict, base_dir: str, span: Span | None) -> dict:
    a = bind_args("text", (("path", REQUIRED), ("context", None), ("test", 0.1), ("seed", 0)), args, kwargs, span)
    if a["context"] is not None and (not _is_int(a["context"]) or a["context"] < 1):
        raise _err("X004", f"text: context must be a whole number of tokens, at least 1, got {a['context']!r}",
                   span, help="write e.g. `text(\"corpus.txt\", context = 128)`, the model's sequence length")
    if not _is_number(a["test"]) or not 0.0 < float(a["test"]) < 1.0:
        raise _err("X004", f"text: test fraction must be a number strictly between 0 and 1, got {a['test']!r}",
                   span, help="write e.g. `test = 0.1` to hold out the last 10% of the text")
    if not _is_int(a["seed"]) or a["seed"] < 0:
        raise _err("X004", f"text: seed must be a non-negative integer, got {a['seed']!r}", span,
                   help="write e.g. `seed = 0` (0 keeps the files in name order)")
    files, shown = _text_files(a["path"], base_dir, span)
    return {**a, "files": files, "shown": shown}


def _load_text(a: dict, span: Span | None, budget: _Budget, sample_shape: tuple[int, ...] | None) -> Dataset:
    """The corpus `a` (check_text's result) as a Dataset of next-token windows (Dataset's
    docstring): the files read under the data limit, each required to be UTF-8, concatenated
    (in name order, or shuffled by rng(seed) when seed > 0), the last `test` fraction of the
    bytes held out."""
    context = a["context"]
    if context is None:
        if not sample_shape or len(sample_shape) != 1:
            raise _err("X004", "text: needs `context`, the tokens per sample", span,
                       help='write e.g. `text("corpus.txt", context = 128)`, the length of the model\'s input')
        context = int(sample_shape[0])
    files = list(a["files"])
    if a["seed"]:
        files = [files[i] for i in np.random.default_rng(int(a["seed"])).permutation(len(files))]
    chunks = []
    for path in files:
        try:
            raw = read_regular(path, budget.left, "the data limit")
        except ReadError as e:
            if e.why == "too_large":
                raise budget.too_large(f"text: `{path}`", max(os.path.getsize(path), budget.left + 1), span) from None
            code = "X002" if e.why in ("missing", "not_regular") else "X003"
            raise _err(code, f"text: `{path}` {e.message}", span) from None
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            raise _err("X003", f"text: `{path}` is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start} "
                       f"(line {line}) {e.reason}", span,
                       help="text() reads UTF-8 (ASCII is UTF-8): convert the file, e.g. "
                            "`iconv -f latin1 -t utf-8 FILE > FILE.utf8`, or leave it out of the pattern") from None
        budget.used += len(raw)
        chunks.append(raw)
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    n = len(tokens)
    where = f"`{a['shown']}`" + (f" ({len(files)} files)" if len(files) > 1 else "")
    if n == 0:
        raise _err("X003", f"text: {where} is empty", span, help="give text files that hold some text")
    test = float(a["test"])
    n_test = math.ceil(test * n)
    n_train = n - n_test
    for side, k in (("training", n_train), ("test", n_test)):
        if k < context + 1:
            raise _err("X003", f"text: {where} holds {n} bytes; with test = {test} the {side} split has {k}, too few "
                       f"for one window of context = {context} (and its next byte: {context + 1} bytes)", span,
                       help="use more text, a smaller context, or another test fraction")
    train, held = tokens[:n_train], tokens[n_train:]
    sw = np.lib.stride_tricks.sliding_window_view
    x_tr, y_tr = sw(train[:-1], context), sw(train[1:], context)
    m = (n_test - 1) // context
    x_te, y_te = held[:m * context].reshape(m, context), held[1:m * context + 1].reshape(m, context)
    name = f"text({a['shown']}, context={context}, test={test}, seed={int(a['seed'])})"
    return Dataset(x_tr, y_tr, x_te, y_te, num_classes=int(tokens.max()) + 1, name=name, kind="text",
                   epoch_samples=(n_train - 1) // context)


# ---------------------------------------------------------------------------------------------
# Model fit


def check_compatible(
    ds: Dataset,
    input_shape: tuple[int, ...],
    label_dtype: str | None,
    num_classes: int | None,
    span: Span | None = None,
) -> None:
    """Check that the data fits the model's inputs.

    input_shape: the model's sample input, batch dimension first (`f32[batch, 64]` -> (128, 64));
    label_dtype: the label input's dtype ("i32", "i64", ...), None to skip; num_classes: the
    model's output classes, None to skip.  Raises StreamschedError X005 when the per-sample shape
    differs from input_shape[1:] (both shapes named), the label input is not an integer type, or
    a label is >= num_classes.
    """
    want = tuple(int(d) for d in input_shape[1:])
    if ds.sample_shape != want:
        n_data, n_model = int(np.prod(ds.sample_shape)), int(np.prod(want))
        hint = (f"both hold {n_data} values per sample; the model's input shape must match the data's"
                if n_data == n_model else
                f"the data has {n_data} values per sample, the model expects {n_model}")
        raise _err("X005", f"data `{ds.name}` has samples of shape {list(ds.sample_shape)} but the model "
                   f"input expects {list(want)} per sample (shape {list(input_shape)} with the batch dimension)",
                   span, help=hint)
    if label_dtype is not None and label_dtype not in ("i32", "i64", "u8"):
        raise _err("X005", f"the model's label input is {label_dtype}, but data labels are integer class "
                   "indices", span, help="declare the label input as i32, e.g. `input y : i32[batch]`")
    if num_classes is not None and ds.num_classes > num_classes:
        top = ds.num_classes - 1
        raise _err("X005", f"data `{ds.name}` has labels up to {top} but the model has {num_classes} "
                   f"classes (0..{num_classes - 1})", span,
                   help=f"give the model's output layer at least {ds.num_classes} units")


# ---------------------------------------------------------------------------------------------
# Batches


class Batches:
    """Fixed-size shuffled batches over (x, y); the order of epoch e depends only on (seed, e).

    x: [N, *features], y: [N] (or [N, t], a text model's next-token labels); yields xb f32
    [batch, *features] and yb i32 [batch], both C-contiguous copies (integer x, token windows,
    and y keep their own integer dtype and are never copied whole: a text data set's windows
    are views).  Each epoch draws one permutation from `np.random.default_rng([seed, e])` (a
    SeedSequence of the pair), so a run resumed at epoch e, step k (`epoch(e, start=k)`) sees
    exactly the batches it would have seen.  epoch_samples (default N) is how many samples an
    epoch takes: the first epoch_samples of its permutation (a text epoch is one pass over the
    training bytes, in random windows out of every position).

    drop_last=True: N // batch batches; the N % batch samples left at the end of this epoch's
    permutation sit out (different ones each epoch).  drop_last=False: ceil(N / batch) batches;
    the last is topped up with the first samples of the same permutation, so every batch keeps
    its shape (CUDA graphs replay fixed shapes) and every sample is seen at least once.

    Raises StreamschedError X006 when batch < 1 or batch > N.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, seed: int, drop_last: bool = True,
                 span: Span | None = None, epoch_samples: int | None = None):
        if len(x) != len(y):
            raise ValueError(f"Batches: {len(x)} samples but {len(y)} labels")
        n = len(x) if epoch_samples is None else min(int(epoch_samples), len(x))
        if not _is_int(batch) or batch < 1 or batch > n:
            what = "training samples" if epoch_samples is None else "windows of one epoch"
            raise _err("X006", f"batch size {batch} does not fit the {n} {what}",
                       span, help=f"use a batch size between 1 and {n} (the model's `batch` parameter)")
        self.x = x if x.dtype.kind in "iu" else np.ascontiguousarray(x, dtype=np.float32)
        self.y = y if y.ndim > 1 and y.dtype.kind in "iu" else np.ascontiguousarray(y, dtype=np.int32)
        self.batch = int(batch)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch_samples = n

    @property
    def num_samples(self) -> int:
        return len(self.x)

    @property
    def steps_per_epoch(self) -> int:
        n, b = self.epoch_samples, self.batch
        return n // b if self.drop_last else -(-n // b)

    def order(self, e: int) -> np.ndarray:
        """The sample indices of epoch e, int64 [steps_per_epoch * batch], in batch order."""
        perm = np.random.default_rng([self.seed, int(e)]).permutation(len(self.x))
        need = self.steps_per_epoch * self.batch
        return perm[:need] if need <= len(perm) else np.concatenate([perm, perm[: need - len(perm)]])

    def epoch(self, e: int, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (xb, yb) for steps start, start+1, ... of epoch e (start > 0 when resuming)."""
        idx = self.order(e)
        for k in range(start, self.steps_per_epoch):
            sel = idx[k * self.batch : (k + 1) * self.batch]
            yield np.take(self.x, sel, axis=0), np.take(self.y, sel, axis=0)
