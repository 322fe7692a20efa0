"""Every file streamsched reads is a regular file under a size limit, read without blocking and
decompressed only as far as the limit allows: a FIFO, a device, a gzip bomb or an .npy header
that claims a terabyte is refused before any large read or allocation.

Limits (docs/data.md, "Limits")::

    SOURCE_LIMIT   16 MiB   each .sched file (the program and each include)
    META_LIMIT     16 MiB   the JSON metadata of a checkpoint
    data_limit()   4 GiB    the bytes a run reads from its data files, decompressed (all arrays
                            together), and the arrays of a checkpoint; raise it with
                            `--data-limit 16G` or STREAMSCHED_DATA_LIMIT=16G

Errors are `ReadError` (why: "missing", "not_regular", "too_large", "unreadable", "corrupt",
"pickle"); each caller turns them into its own diagnostic code (X002/X003/X007/S010, X014 for
"too_large").  Nothing here unpickles: .npz members are parsed with NumPy's documented .npy
header readers (numpy.lib.format) and filled with readinto.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
import zipfile
import zlib
from typing import BinaryIO

import numpy as np

SOURCE_LIMIT = 16 * 2**20
META_LIMIT = 16 * 2**20
DEFAULT_DATA_LIMIT = 4 * 2**30
DATA_LIMIT_ENV = "STREAMSCHED_DATA_LIMIT"


class ReadError(Exception):
    """A file that cannot be read as asked.  why: "missing" | "not_regular" | "too_large" |
    "unreadable" | "corrupt" | "pickle"; message: what is wrong, in the user's words, without the
    file's name (the caller says which file and which role it plays)."""

    def __init__(self, why: str, message: str, *, member: str | None = None, need: int | None = None,
                 limit: int | None = None):
        super().__init__(message)
        self.why = why
        self.message = message
        self.member = member  # "too_large": the member over its own limit (member_limits), else None
        self.need = need  # "too_large": the bytes the read needed
        self.limit = limit  # "too_large": the limit it is over


def human_size(n: int) -> str:
    """`n` bytes the way the limits are written: 16 MiB, 4 GiB, 1.5 KiB, 300 bytes."""
    if n < 1024:
        return f"{n} byte{'s' if n != 1 else ''}"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        x /= 1024
        if x < 1024 or unit == "EiB":
            return f"{x:.0f} {unit}" if x == int(x) else f"{x:.1f} {unit}"
    return f"{n} bytes"  # pragma: no cover


def limit_hint(n: int) -> str:
    """A `--data-limit` value that admits `n` bytes, as a user writes it: the next whole number of
    the largest unit that fits (5.3 GiB -> `6G`, 1300 bytes -> `2K`), so a help line that suggests
    it is a fix."""
    for unit, k in (("T", 4), ("G", 3), ("M", 2), ("K", 1)):
        if n >= 1024 ** k:
            return f"{-(-n // 1024 ** k)}{unit}"
    return f"{max(1, n)}"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.I)


def parse_size(text: str) -> int:
    """A size as a user writes it: `4G`, `512M`, `16GiB`, `1.5g`, `1000000` (bytes).  Suffixes are
    binary (K = 1024).  Raises ValueError for anything else, zero included."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or (not unit and "i" in m.group(3).lower()):
        raise ValueError(f"not a size: {text!r} (write e.g. 512M, 4G or a number of bytes)")
    n = float(m.group(1)) * (1024 ** ("kmgtp".index(unit) + 1) if unit else 1)
    if n < 1:
        raise ValueError(f"a size limit must be at least 1 byte, got {text!r}")
    return int(n)


def data_limit(given: int | None = None) -> int:
    """The data limit in bytes: `given` (from `--data-limit`), else $STREAMSCHED_DATA_LIMIT, else
    4 GiB.  Raises ValueError for an environment value that is not a size."""
    if given is not None:
        return int(given)
    env = os.environ.get(DATA_LIMIT_ENV)
    if env:
        try:
            return parse_size(env)
        except ValueError as e:
            raise ValueError(f"${DATA_LIMIT_ENV}: {e}") from None
    return DEFAULT_DATA_LIMIT


def file_kind(mode: int) -> str:
    """What a non-regular file is, as a noun phrase: "a folder", "a FIFO (named pipe)"..."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


def open_regular(path: str) -> int:
    """Open `path` for reading and return the descriptor, only when it is a regular file (links
    followed).  The open does not block (O_NONBLOCK: a FIFO with no writer would), and the kind
    is checked on the open descriptor, so a file swapped for a FIFO after a check is still
    refused.  Raises ReadError "missing", "not_regular" or "unreadable"."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ReadError("missing", "does not exist") from None
    except IsADirectoryError:
        raise ReadError("not_regular", "is a folder, not a file") from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket, or a FIFO opened for writing
            raise ReadError("not_regular", "is not a regular file") from None
        raise ReadError("unreadable", f"cannot be read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:  # pragma: no cover (fstat of an open descriptor)
        os.close(fd)
        raise ReadError("unreadable", f"cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = file_kind(st.st_mode)
        raise ReadError("not_regular", f"is {kind}, not a regular file" if kind.startswith("a ") else
                        "is not a regular file")
    try:  # reads of a regular file never block; clear the flag for the readers that follow
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except (ImportError, OSError, AttributeError):  # pragma: no cover (Windows)
        pass
    return fd


def read_regular(path: str, limit: int, what: str = "the file") -> bytes:
    """All bytes of the regular file `path`, at most `limit` of them: a file larger than the limit
    (on disk, or grown while being read) is ReadError "too_large", naming `what` and the limit."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ReadError("too_large", f"is {human_size(size)}, over the {human_size(limit)} limit of {what}")
        try:
            raw = f.read(limit + 1)
        except OSError as e:
            raise ReadError("unreadable", f"cannot be read: {e.strerror or e}") from None
    if len(raw) > limit:
        raise ReadError("too_large", f"is over the {human_size(limit)} limit of {what}")
    return raw


def read_head(path: str, n: int) -> bytes:
    """The first `n` bytes of the regular file `path` (fewer when it is shorter); ReadError as
    open_regular."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(n)
        except OSError as e:
            raise ReadError("unreadable", f"cannot be read: {e.strerror or e}") from None


def read_exactly(f: BinaryIO, n: int) -> bytes:
    """n bytes from a stream (gzip, zip member), fewer only at its end."""
    chunks = []
    while n > 0:
        b = f.read(min(n, 1 << 24))
        if not b:
            break
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


# ---------------------------------------------------------------------------------------------
# .npz archives, bounded


def read_npz(path: str, limit: int, keys: tuple[str, ...] | None = None,
             member_limits: dict[str, int] | None = None) -> tuple[list[str], dict[str, np.ndarray]]:
    """The arrays of the .npz archive `path` (as np.savez writes it: one NAME.npy member per
    array): (every member's name, name -> array for `keys`, or for every member when keys is None;
    keys that are absent are left out).

    Bounded: the declared uncompressed sizes of the members read must sum to at most `limit`
    (ReadError "too_large", before anything is decompressed; `member_limits` sets a tighter limit
    per name); each member's .npy header must describe exactly the bytes the member holds
    ("corrupt" otherwise: a header claiming 2e12 elements is refused before any allocation), and
    object dtypes are "pickle".  Never unpickles.  Other ReadErrors as open_regular; a broken zip
    or CRC is "corrupt"."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        try:
            zf = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError,
                RuntimeError, KeyError, UnicodeDecodeError, struct.error) as e:  # what a broken archive raises
            raise ReadError("corrupt", f"is not a readable .npz archive ({e or type(e).__name__})") from None
        with zf:
            infos: dict[str, zipfile.ZipInfo] = {}
            for info in zf.infolist():
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                if name in infos:
                    raise ReadError("corrupt", f"holds the member `{name}` twice")
                infos[name] = info
            names = list(infos)
            wanted = [k for k in (keys if keys is not None else names) if k in infos]
            total = 0
            for k in wanted:
                size = infos[k].file_size
                own = (member_limits or {}).get(k)
                if own is not None and size > own:
                    raise ReadError("too_large", f"has a `{k}` of {human_size(size)}, over its "
                                    f"{human_size(own)} limit", member=k, need=size, limit=own)
                total += size
            if total > limit:
                raise ReadError("too_large", f"holds {human_size(total)} of arrays (uncompressed), over the "
                                f"{human_size(limit)} data limit", need=total, limit=limit)
            arrays = {k: _read_member(zf, infos[k], k) for k in wanted}
    return names, arrays


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, key: str) -> np.ndarray:
    fmt = np.lib.format
    try:
        with zf.open(info) as m:
            magic = read_exactly(m, len(fmt.MAGIC_PREFIX) + 2)
            if not magic.startswith(fmt.MAGIC_PREFIX) or len(magic) < len(fmt.MAGIC_PREFIX) + 2:
                if magic[:1] == b"\x80":  # a pickle's PROTO opcode
                    raise ReadError("pickle", f"member `{key}` holds pickled data, not a NumPy .npy array")
                raise ReadError("corrupt", f"member `{key}` is not a NumPy .npy array")
            version = (magic[-2], magic[-1])
            try:
                if version == (1, 0):
                    shape, fortran, dtype = fmt.read_array_header_1_0(m)
                elif version in ((2, 0), (3, 0)):
                    shape, fortran, dtype = fmt.read_array_header_2_0(m)
                else:
                    raise ValueError(f"unknown .npy format version {version}")
            except (ValueError, SyntaxError, TypeError, EOFError) as e:
                raise ReadError("corrupt", f"member `{key}` has a broken .npy header ({numpy_words(e)})") from None
            if dtype.hasobject:
                raise ReadError("pickle", f"member `{key}` is an object (pickled) array")
            count = 1
            for d in shape:
                count *= int(d)
            nbytes = count * dtype.itemsize
            left = info.file_size - m.tell()
            if nbytes != left or (dtype.itemsize == 0 and count):
                raise ReadError("corrupt", f"member `{key}`: its header claims shape {tuple(shape)} of "
                                f"{dtype} ({human_size(nbytes)}) but the member holds {human_size(max(left, 0))}")
            buf = np.empty(nbytes, np.uint8)
            view = memoryview(buf)
            got = 0
            while got < nbytes:
                n = m.readinto(view[got:])
                if not n:
                    break
                got += n
            if got != nbytes:
                raise ReadError("corrupt", f"member `{key}` is truncated")
            if nbytes == 0 or dtype.itemsize == 0:
                return np.zeros(shape, dtype)
            return buf.view(dtype).reshape(shape, order="F" if fortran else "C")
    except ReadError:
        raise
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, RuntimeError, NotImplementedError,
            OverflowError, MemoryError, KeyError, UnicodeDecodeError, struct.error) as e:
        raise ReadError("corrupt", f"member `{key}` cannot be read ({numpy_words(e)})") from None


def numpy_words(e: BaseException) -> str:
    """An exception from NumPy's readers in our words: its advice to load a file unsafely
    (`allow_pickle=True`, a larger `max_header_size`) is never the fix here, since streamsched
    never unpickles and never reads a header NumPy calls unsafe."""
    msg = str(e) or type(e).__name__
    low = msg.lower()
    if "max_header_size" in low or "header info length" in low:
        m = re.search(r"\((\d+)\)", msg)
        size = f" of {human_size(int(m.group(1)))}" if m else ""
        return f"its .npy header{size} is longer than NumPy reads safely (10000 bytes); a file np.save wrote has a " \
               "header of about 128 bytes"
    if "pickle" in low:
        return "it holds pickled (object) data, which streamsched never loads"
    return msg
