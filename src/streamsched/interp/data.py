"""Training data for the `train` block: `data = SOURCE(...)` becomes a `Dataset` of host arrays,
checked against the model's inputs and cut into fixed-shape, deterministically shuffled batches.

Sources (LANGUAGE.md, the `train` block)::

    digits(test = 0.2, seed = 0)   scikit-learn's bundled 8x8 digits, 1797 samples, stratified split
    idx("path/to/dir")             MNIST-format IDX files (train-/t10k- images and labels, .gz or not)
    npz("file.npz")                keys x_train, y_train, x_test, y_test; never unpickled

Every user mistake is a `StreamschedError` with an X code (docs/data.md): X001 unknown source,
X002 missing file, X003 corrupt file, X004 bad argument, X005 data does not fit the model,
X006 batch size does not fit the data.  Nothing here imports CuPy.
"""

from __future__ import annotations

import difflib
import gzip
import math
import os
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.ir import Span

SOURCES = ("digits", "idx", "npz")
"""The data sources `load_dataset` knows, in the order the error message lists them."""

REQUIRED = object()
"""Marks a parameter of `bind_args` that has no default."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held in host memory; the arrays are read-only.

    x_train: f32 [N, *features], y_train: i32 [N] with values in [0, num_classes);
    x_test: f32 [M, *features], y_test: i32 [M].  name says where it came from
    (`digits(test=0.2, seed=0)`, `idx(/abs/dir)`, `npz(/abs/file.npz)`).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str

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


def load_dataset(source: str, args: tuple, kwargs: dict, *, base_dir: str, span: Span | None = None) -> Dataset:
    """Load `source(*args, **kwargs)` from the `train` block's `data = ...` line.

    source: "digits" | "idx" | "npz"; args/kwargs: the literal arguments as parsed (numbers,
    strings); base_dir: the .sched file's folder, against which relative paths resolve;
    span: the `data = ...` line, put on every diagnostic.
    Returns a `Dataset` (x f32 [N, *features] in [0, 1] for digits and idx, y i32 [N]).
    Raises StreamschedError X001 unknown source, X002 missing file or folder, X003 corrupt or
    unreadable file, X004 bad argument.
    """
    a = check_source(source, args, kwargs, base_dir=base_dir, span=span)
    if source == "digits":
        return _load_digits(a["test"], a["seed"], span)
    if source == "idx":
        return _load_idx_dir(a["path"], span)
    return _load_npz(a["path"], span)


DIGITS_SAMPLES = 1797
"""The samples of the `digits` source (scikit-learn's copy of the UCI optical digits)."""


def digits_train_samples(test: float) -> int:
    """How many training samples `digits(test = t)` holds: train_test_split's rule, the test
    split takes ceil(t * n) samples (stratification does not change the counts)."""
    return DIGITS_SAMPLES - math.ceil(float(test) * DIGITS_SAMPLES)


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
        is_kind, kind, other = (os.path.isdir, "folder", "file") if source == "idx" else (os.path.isfile, "file", "folder")
        if not is_kind(path):
            what = f"is a {other}, not a {kind}" if os.path.exists(path) else "does not exist"
            raise _err("X002", f"{source}: data {kind} `{path}` {what}", span,
                       help="relative paths are resolved against the folder of the .sched file that writes them")
        return {**a, "path": path}
    raise _err(
        "X001",
        f"unknown data source `{source}`",
        span,
        help=f"{_did_you_mean(source, SOURCES)}known sources: "
        'digits(test = 0.2, seed = 0), idx("path/to/mnist"), npz("file.npz")',
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
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _read_idx(directory: str, key: str, span: Span | None) -> np.ndarray:
    for base in _IDX_FILES[key]:
        for path in (os.path.join(directory, base), os.path.join(directory, base + ".gz")):
            if os.path.isfile(path):
                try:
                    if path.endswith(".gz"):
                        with gzip.open(path, "rb") as f:
                            raw = f.read()
                    else:
                        with open(path, "rb") as f:
                            raw = f.read()
                except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                    raise _err("X003", f"cannot read `{path}`: {e}", span,
                               help="re-download the file; a .gz file must be a complete gzip stream") from None
                return parse_idx(raw, path, span)
    names = ", ".join(f"{n}[.gz]" for n in _IDX_FILES[key])
    raise _err("X002", f"idx: `{directory}` has no {_IDX_FILES[key][0]} (or .gz)", span,
               help=f"an MNIST-format folder holds four files; looked for {names}")


def _load_idx_dir(directory: str, span: Span | None) -> Dataset:
    """An MNIST-format folder, already checked to exist by check_source."""
    a = {key: _read_idx(directory, key, span) for key in _IDX_FILES}
    for key in ("x_train", "x_test"):
        if a[key].ndim < 2:
            raise _err("X003", f"idx: {_IDX_FILES[key][0]} has shape {a[key].shape}; images need at least "
                       "2 dimensions (samples, pixels...)", span)
        # Pixels stored as bytes are scaled to [0, 1]; other types are taken as they are.
        scale = 255.0 if a[key].dtype == np.uint8 else 1.0
        a[key] = (a[key].reshape(len(a[key]), -1) / scale).astype(np.float32)
    return _make_dataset(a["x_train"], a["y_train"], a["x_test"], a["y_test"], f"idx({directory})", span, "idx")


def archive_kind(path: str) -> str:
    """What a file's first bytes say it is: "npz" (a zip archive, as np.savez writes), "npy"
    (one array, np.save), or what anything else is, as a phrase ("it is empty", "it holds text",
    "it is some other binary file").  Read errors are left to the caller's np.load."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return "npz"  # let np.load report it
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
    """An exception from np.load in our words: numpy's advice to load a file unsafely
    (`allow_pickle=`) is never the fix here, since streamsched never unpickles."""
    msg = str(e)
    if "pickle" in msg.lower():
        return "it holds pickled (object) data, which streamsched never loads"
    return msg or type(e).__name__


def _load_npz(path: str, span: Span | None) -> Dataset:
    """An .npz archive, already checked to be a file by check_source."""
    keys = ("x_train", "y_train", "x_test", "y_test")
    bad_file = "the file must be written by np.savez or np.savez_compressed"
    kind = archive_kind(path)
    if kind not in ("npz", "npy"):
        # np.load would take it for a pickle and suggest allow_pickle; streamsched never unpickles.
        raise _err("X003", f"npz: `{path}` is not an .npz archive ({kind})", span, help=bad_file)
    try:
        z = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise _err("X003", f"npz: `{path}` is not a readable .npz archive ({own_words(e)})", span,
                   help=bad_file) from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise _err("X003", f"npz: `{path}` holds a single array, not an .npz archive", span,
                   help="save with np.savez(path, x_train=..., y_train=..., x_test=..., y_test=...)")
    with z:
        missing = [k for k in keys if k not in z.files]
        if missing:
            raise _err("X003", f"npz: `{path}` lacks key{'s' if len(missing) > 1 else ''} "
                       f"{', '.join(missing)} (it has: {', '.join(z.files) or 'nothing'})", span,
                       help="the archive needs x_train, y_train, x_test, y_test")
        a = {}
        for k in keys:
            try:
                a[k] = z[k]
            except ValueError as e:
                if "pickle" in str(e).lower():
                    raise _err("X003", f"npz: `{k}` in `{path}` is an object (pickled) array; "
                               "streamsched never unpickles data", span,
                               help="store plain numeric arrays: x as float, y as integer class indices") from None
                raise _err("X003", f"npz: cannot read `{k}` from `{path}`: {own_words(e)}", span,
                           help=bad_file) from None
            except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
                raise _err("X003", f"npz: cannot read `{k}` from `{path}`: {e}", span, help=bad_file) from None
    for k in ("x_train", "x_test"):
        if a[k].dtype.kind not in "biuf" or a[k].ndim < 2:
            raise _err("X003", f"npz: `{k}` must be a numeric array [samples, features...], got "
                       f"{a[k].dtype} with shape {a[k].shape}", span)
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
        top = int(max(ds.y_train.max(), ds.y_test.max() if len(ds.y_test) else 0))
        raise _err("X005", f"data `{ds.name}` has labels up to {top} but the model has {num_classes} "
                   f"classes (0..{num_classes - 1})", span,
                   help=f"give the model's output layer at least {ds.num_classes} units")


# ---------------------------------------------------------------------------------------------
# Batches


class Batches:
    """Fixed-size shuffled batches over (x, y); the order of epoch e depends only on (seed, e).

    x: [N, *features], y: [N]; yields xb f32 [batch, *features] and yb i32 [batch], both
    C-contiguous copies.  Each epoch draws one permutation from
    `np.random.default_rng([seed, e])` (a SeedSequence of the pair), so a run resumed at epoch e,
    step k (`epoch(e, start=k)`) sees exactly the batches it would have seen.

    drop_last=True: N // batch batches; the N % batch samples left at the end of this epoch's
    permutation sit out (different ones each epoch).  drop_last=False: ceil(N / batch) batches;
    the last is topped up with the first samples of the same permutation, so every batch keeps
    its shape (CUDA graphs replay fixed shapes) and every sample is seen at least once.

    Raises StreamschedError X006 when batch < 1 or batch > N.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, seed: int, drop_last: bool = True,
                 span: Span | None = None):
        if len(x) != len(y):
            raise ValueError(f"Batches: {len(x)} samples but {len(y)} labels")
        n = len(x)
        if not _is_int(batch) or batch < 1 or batch > n:
            raise _err("X006", f"batch size {batch} does not fit the {n} training samples",
                       span, help=f"use a batch size between 1 and {n} (the model's `batch` parameter)")
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.y = np.ascontiguousarray(y, dtype=np.int32)
        self.batch = int(batch)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)

    @property
    def num_samples(self) -> int:
        return len(self.x)

    @property
    def steps_per_epoch(self) -> int:
        n, b = len(self.x), self.batch
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
