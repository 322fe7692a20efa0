"""Every file streamsched writes is checked before any work, so that nothing a user had is lost:
an output is a new file or a regular file of the kind the command writes (a checkpoint only
replaces a checkpoint streamsched wrote, a log only appends to such a log, a plan only replaces
a plan...), never the program, one of its includes, a data file or another input, never a
folder, FIFO, device or symbolic link, and never the same file as another output of the run.
A run's checkpoint and log are held by an advisory lock (a `.NAME.lock` file next to each,
fcntl.flock) naming the run that holds it.

Symbolic links: an output that is a symbolic link is refused rather than written through, since
writing through would replace or grow a file elsewhere that the command line does not name, and
replacing the link would destroy it (docs/errors.md, X021).  Folders on the way (`/tmp` as a
link) are followed as usual.

Codes: X021 an output that cannot or must not be written; X009 an output in use by another run.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.ir import Span
from streamsched.reads import ReadError, file_kind, read_head

KINDS = ("checkpoint", "log", "plan", "graph", "trace", "picture")
"""What an output holds: a checkpoint (`--save`), a JSON-lines log (`--log`, the train block's
`log`), a text plan (`lower -o`), a drawing of the plan (`graph -o`: .dot/.gv text or an
.svg/.png/.pdf picture), a Chrome trace (`trace -o`), a picture (`trace --png`)."""


@dataclass(frozen=True)
class Output:
    """A checked output: path as the user wrote it, full its absolute form, kind one of KINDS,
    noun ("the checkpoint"), origin the option it came from ("--save"; "" for the train block,
    then span is its line), exists whether a file is there now."""

    path: str
    full: str
    kind: str
    noun: str
    origin: str
    span: Span | None
    exists: bool

    @property
    def named(self) -> str:
        return f"{self.noun} `{self.path}`" + (f" ({self.origin})" if self.origin else "")


def _x(code: str, msg: str, span=None, help: str = "") -> StreamschedError:
    return StreamschedError([Diagnostic(code, msg, span, help=help)])


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file: os.path.samefile when both exist (hard links and links
    on the way included), else their resolved absolute paths."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output(path, kind: str, *, noun: str, origin: str = "", span: Span | None = None,
                 inputs: Iterable[tuple[str, str]] = (), append: bool = False,
                 replaceable: Iterable[str] = ()) -> Output:
    """Refuse, before any work, an output that cannot be written or must not be: a folder, a
    FIFO, a device, a socket or a symbolic link; a file in a folder that does not exist or cannot
    be written; an input (`inputs`: (path, what it is) pairs, e.g. (program, "the program being
    run")), compared by os.path.samefile so a hard link or a path through a linked folder is
    caught; an existing file of another kind than `kind` (see `kind_of`).  An empty file holds
    nothing to lose and may always be used.  `replaceable`: inputs that this output may replace
    all the same (`--resume ck.npz --save ck.npz` continues a checkpoint in place).
    append: the file grows in place (a log), else it is replaced through a temporary file in its
    folder.  Returns the Output; raises StreamschedError X021 (X004 for a path that is not a
    non-empty string)."""
    flag = origin or "`log`"
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise _x("X004", f"{flag} needs a file name, got {path!r}", span,
                 help=f"e.g. `{origin} run.out`" if origin else 'write e.g. `log = "run.jsonl"`')
    path = os.fspath(path)
    full = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(full)
    out = Output(path, full, kind, noun, origin, span, False)

    def fail(why: str, help: str) -> StreamschedError:
        return _x("X021", f"cannot write {out.named}: {why}", span, help=help)

    try:
        st = os.lstat(full)
    except FileNotFoundError:
        st = None
    except OSError as e:  # a path through a file, a name too long...
        raise fail(e.strerror or str(e), "name a file in an existing folder you can write to") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(full)
        try:  # suggest the target only where it could be written in the link's place
            check_output(target, kind, noun=noun, origin=origin, span=span, inputs=inputs, append=append,
                         replaceable=replaceable)
            fix = f"name the file itself (`{target}`) or a new file"
        except StreamschedError:
            fix = "name a new file"
        raise fail(f"it is a symbolic link (to `{target}`); streamsched does not write through links, so that "
                   "a file the command line does not name is never replaced or grown", fix)
    if st is not None and stat.S_ISDIR(st.st_mode):
        example = os.path.join(path, {"checkpoint": "run.npz", "log": "run.jsonl"}.get(kind, "out.txt"))
        raise fail("it is a folder", f"name a file in it, e.g. `{example}`")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise fail(f"it is {file_kind(st.st_mode)}, not a regular file",
                   "name a regular file (a new one, or one this command wrote before)")
    if not os.path.isdir(parent):
        why = f"the folder `{parent}` does not exist" if not os.path.exists(parent) else f"`{parent}` is not a folder"
        raise fail(why, "create the folder first, or name a file in an existing folder")
    if append and st is not None:  # a log grows in place (its lock file still needs the folder)
        if not os.access(full, os.W_OK):
            raise fail("the file is not writable", "name another file, or make it writable")
    if not os.access(parent, os.W_OK | os.X_OK):  # a new file, a temporary, a lock file
        raise fail(f"the folder `{parent}` is not writable", "name a file in a folder you can write to")
    keep = [p for p in replaceable if p]
    for p, what in inputs:
        if p and os.path.lexists(p) and same_file(full, p) and not any(same_file(full, k) for k in keep):
            raise fail(f"it is {what}", "name another file; streamsched never overwrites what a run reads")
    if st is not None and st.st_size > 0:
        ok, what = kind_of(full, kind)
        if not ok:
            raise fail(f"it is {what}, not {_KIND_NOUN[kind]}",
                       f"{_KIND_RULE[kind]}; name a new file (or move this one away)")
    return Output(path, full, kind, noun, origin, span, st is not None)


def check_distinct(outputs: Iterable[Output | None]) -> None:
    """Refuse two outputs of one command that are one file (X021 at the later one)."""
    seen: list[Output] = []
    for o in outputs:
        if o is None:
            continue
        for s in seen:
            if same_file(o.full, s.full):
                raise _x("X021", f"cannot write {o.named}: it is also {s.named}", o.span,
                         help="give each output its own file")
        seen.append(o)


_KIND_NOUN = {
    "checkpoint": "a checkpoint streamsched wrote",
    "log": "a log streamsched wrote",
    "plan": "a plan `streamsched lower` wrote",
    "graph": "a drawing of that format",
    "trace": "a Chrome trace",
    "picture": "a picture of that format",
}
_KIND_RULE = {
    "checkpoint": "a checkpoint only replaces a checkpoint streamsched wrote",
    "log": "a log only appends to a log streamsched wrote",
    "plan": "`lower -o` only replaces a plan it wrote",
    "graph": "`graph -o` only replaces a drawing of the same format",
    "trace": "`trace -o` only replaces a Chrome trace",
    "picture": "a picture only replaces a picture of the same format",
}


def kind_of(full: str, kind: str) -> tuple[bool, str]:
    """Whether the non-empty regular file `full` is of `kind` (reading at most 64 KiB, or a
    checkpoint's metadata): a checkpoint by its metadata (checkpoint.written_by_us), a log by its
    first line (a JSON object with `epoch` and `train_loss`), a plan by its first line
    (`plan: ...`), a drawing or picture by its format (.dot/.gv text starting `digraph`; SVG, PNG
    or PDF magic), a trace by a JSON object with `traceEvents`.  Returns (yes, what it is)."""
    if kind == "checkpoint":
        from streamsched.interp.checkpoint import written_by_us

        return written_by_us(full)
    try:
        head = read_head(full, 65536)
    except ReadError as e:
        return False, f"a file that {e.message}"
    what = _describe(head)
    ext = os.path.splitext(full)[1].lower()
    if kind == "log":
        line = head.split(b"\n", 1)[0]
        try:
            rec = json.loads(line)
        except ValueError:
            return False, what
        return (isinstance(rec, dict) and {"epoch", "train_loss"} <= set(rec)), what
    if kind == "plan":
        return head.startswith(b"plan: "), what
    if kind in ("graph", "picture"):
        if ext in (".dot", ".gv"):
            return head.lstrip().startswith((b"digraph", b"strict digraph")), what
        if ext == ".svg":
            return b"<svg" in head[:4096], what
        if ext == ".png":
            return head.startswith(b"\x89PNG\r\n\x1a\n"), what
        if ext == ".pdf":
            return head.startswith(b"%PDF-"), what
        return False, what
    if kind == "trace":
        return head.lstrip().startswith(b"{") and b'"traceEvents"' in head, what
    return False, what  # pragma: no cover


def _describe(head: bytes) -> str:
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "a zip archive (an .npz?)"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy array"
    if head.startswith(b"\x89PNG"):
        return "a PNG picture"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip file"
    try:
        head.decode("utf-8")
        return "a text file"
    except UnicodeDecodeError as e:
        return "a text file" if e.start > len(head) - 4 else "a binary file"


# ---------------------------------------------------------------------------------------------
# Atomic replacement of outputs other than checkpoints


@contextmanager
def replaced(out: Output) -> Iterator[str]:
    """A temporary path next to `out` (with its suffix, for writers that choose the format by it)
    to write the whole output to; on success it replaces `out` (checkpoint.replace_atomically),
    on failure it is removed and `out` is untouched.  Raises OSError as atomic_temp."""
    from streamsched.interp.checkpoint import _unlink_quietly, atomic_temp, replace_atomically

    fd, tmp = atomic_temp(out.full, keep_suffix=True)
    os.close(fd)
    try:
        yield tmp
        replace_atomically(tmp, out.full)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def remove_stale_temps(full: str) -> list[str]:
    """Remove the temporary files a killed run left next to `full` (checkpoint.temp_pattern;
    regular files only).  Call it holding `full`'s lock, so no live run's temporary is taken.
    Returns the names removed."""
    from streamsched.interp.checkpoint import temp_pattern

    pat = temp_pattern(full)
    folder = os.path.dirname(full)
    gone = []
    try:
        names = os.listdir(folder)
    except OSError:
        return gone
    for name in sorted(names):
        if pat.match(name):
            p = os.path.join(folder, name)
            try:
                if stat.S_ISREG(os.lstat(p).st_mode):
                    os.unlink(p)
                    gone.append(name)
            except OSError:
                pass
    return gone


# ---------------------------------------------------------------------------------------------
# Runs: ids, locks, logs


def new_run_id() -> str:
    """A run's id: its start time and 4 random hex digits, `20250101-120000-3fa2` (sortable,
    short enough to grep a log for)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def lock_path(full: str) -> str:
    """Where the lock of output `full` lives: `.NAME.lock` in its folder."""
    return os.path.join(os.path.dirname(full), f".{os.path.basename(full)}.lock")


class OutputLock:
    """An advisory lock (fcntl.flock, exclusive, non-blocking) on an output, held through the
    file `lock_path(out.full)`, whose content names the holder as JSON (pid, host, run, started,
    command).  The holder removes the file on release; a run that was killed leaves it behind
    unlocked, and the next run takes it over.  Where fcntl is missing (Windows) nothing is
    locked."""

    def __init__(self, out: Output, holder: dict):
        self.out = out
        self.holder = holder
        self.path = lock_path(out.full)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise StreamschedError X009 naming the run that holds it (X021 when the
        lock file cannot be made)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover (Windows)
            return
        for _ in range(10):  # a holder may remove the file between our open and our flock: retry
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0), 0o644)
            except OSError as e:
                raise _x("X021", f"cannot write {self.out.named}: cannot make its lock file `{self.path}` "
                         f"({e.strerror or e})", self.out.span,
                         help="streamsched keeps a `.NAME.lock` file next to a checkpoint or log while a run "
                              "writes it; name a file in a folder you can write to") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise _x("X021", f"cannot write {self.out.named}: its lock file `{self.path}` is not a regular "
                         "file", self.out.span, help="remove it, or name another output")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    return  # a file system without locks: go on unlocked
                info = _read_holder(fd)
                os.close(fd)
                raise self._busy(info) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed it after we opened it
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(self.holder) + "\n").encode())
            self.fd = fd
            return
        raise _x("X009", f"{self.out.named} is in use: its lock kept changing hands", self.out.span)  # pragma: no cover

    def _busy(self, info: dict) -> StreamschedError:
        who = []
        if info.get("run"):
            who.append(f"run {info['run']}")
        if info.get("pid"):
            who.append(f"pid {info['pid']}" + (f" on {info['host']}" if info.get("host") else ""))
        if info.get("started"):
            who.append(f"started {info['started']}")
        holder = ", ".join(who) or "another process"
        here = info.get("host") == socket.gethostname() and info.get("pid")
        stop = f", or stop it (`kill {info['pid']}`)" if here else ""
        flag = self.out.origin or "the train block's `log`"
        return _x("X009", f"{self.out.named} is in use by another run ({holder})", self.out.span,
                  help=f"wait for that run to finish{stop}, or give this run another file with {flag}")

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still holding it: a waiter sees the inode change and retries
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8", errors="replace") or "{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def holder_info(run_id: str, command: list[str] | None = None) -> dict:
    """What a lock file says of the run holding it."""
    return {"run": run_id, "pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S%z"), "command": command or []}


def open_log(out: Output):
    """Open the log `out` for appending, as text: never following a symbolic link, never blocking
    (a FIFO put there since the check is refused), and only a regular file.  A last line that a
    killed run left unfinished is ended first, so the next record starts on its own line.
    Raises StreamschedError X021."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) \
        | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(out.full, flags, 0o644)
    except OSError as e:
        raise _x("X021", f"cannot write {out.named}: {e.strerror or e}", out.span,
                 help="name a regular file in a folder you can write to") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _x("X021", f"cannot write {out.named}: it is {file_kind(st.st_mode)}, not a regular file", out.span,
                 help="name a regular file")
    f = os.fdopen(fd, "a", encoding="utf-8")
    if st.st_size:
        try:
            rfd = os.open(out.full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
            try:
                last = os.pread(rfd, 1, st.st_size - 1)
            finally:
                os.close(rfd)
            if last != b"\n":
                f.write("\n")
        except OSError:
            pass
    return f
