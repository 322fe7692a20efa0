"""Every file streamsched writes is checked before any work, and a run's checkpoint and log again
before each write, so that nothing a user had is lost.

Which existing files an output may replace (docs/errors.md, X021, "Which files an output may
replace"; one policy for every output):

- a new file, or an empty regular file (nothing to lose), may always be written;
- an existing file only when streamsched wrote it as that kind of output, told by the mark
  streamsched leaves in every file it writes (`mark_file`; the format alone proves nothing: a
  photo is a PNG too):

      checkpoint (--save)        its metadata's `writer` ("streamsched X.Y.Z"); and it is replaced
                                 only by the run that continues it (`--resume CK --save CK`), or
                                 on purpose with `--overwrite`: a new run never silently replaces
                                 trained weights (another model's, or a long run's when --resume
                                 was forgotten)
      log (--log, train `log`)   its first line is an epoch record; a log is only appended to
      plan (lower -o)            first line `# written by streamsched X.Y.Z ...`
      drawing (graph -o)         .dot/.gv: first line `// written by streamsched ...`; .svg: an
      picture (trace --png)      XML comment `<!-- written by streamsched ... -->`; .png: a tEXt
                                 chunk `Comment` = `written by streamsched ...` after IHDR; .pdf:
                                 a comment line after `%%EOF`
      trace (trace -o)           `"otherData": {"written_by": "streamsched ..."}`, its first key

- never a file the user protected: one without a write bit (`chmod 444`: refused even as root,
  whose access() would say yes), or one this user cannot write in place (a rename in a writable
  folder could replace it all the same);
- never a folder, a FIFO, a device, a socket or a symbolic link; never a path that ends in `/`;
  never in a folder that does not exist or cannot be written;
- never an input of the run (the program, its includes, its data, a checkpoint it reads; as
  files: a hard link or a path through a linked folder is the same file), never the same file
  as another output;
- never a name streamsched keeps for its own files next to an output (`is_reserved_name`):
  `.NAME.streamsched-lock` (the lock) and `.NAME.streamsched-XXXXXXXX.tmp` (a temporary file),
  so no output can be a lock or temporary file of another, and removing stale temporary files
  or a lock never touches a user's file.

Symbolic links: an output that is a symbolic link is refused rather than written through, since
writing through would replace or grow a file elsewhere that the command line does not name, and
replacing the link would destroy it.  Folders on the way (`/tmp` as a link) are followed.

A run's checkpoint and log are held by an advisory lock (fcntl.flock) on the file
`.NAME.streamsched-lock` next to each, whose content names the holder; a log is also locked
through its own inode, so two runs cannot append to one file under two names (hard links).  A
lock file is created or taken over only when it is one streamsched wrote (a user's file at that
path is refused, never truncated or removed), and removed by its holder.  Names too long for the
folder's NAME_MAX are shortened with a hash (`aux_base`), so every output name the folder allows
gets a lock and temporary file.

Codes: X021 an output that cannot or must not be written; X009 an output in use by another run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import socket
import stat
import struct
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

from streamsched import __version__
from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.interp.ir import Span
from streamsched.auxnames import (LOCK_SUFFIX, TEMP_INFIX, aux_base, lock_path, temp_pattern,  # noqa: F401
                                  temp_prefix, temp_suffix)
from streamsched.reads import ReadError, file_kind, open_regular, read_head

KINDS = ("checkpoint", "log", "plan", "graph", "trace", "picture")
"""What an output holds: a checkpoint (`--save`), a JSON-lines log (`--log`, the train block's
`log`), a text plan (`lower -o`), a drawing of the plan (`graph -o`: .dot/.gv text or an
.svg/.png/.pdf picture), a Chrome trace (`trace -o`), a picture (`trace --png`)."""

MARK = "written by streamsched"
"""The words every file streamsched writes carries (with its version after them)."""
STAMP = f"{MARK} {__version__}"
_TEMP_NAME = re.compile(r"^\..*\.streamsched-[A-Za-z0-9_]{8}\.tmp(\.[^./]*)?$", re.DOTALL)


@dataclass(frozen=True)
class Output:
    """A checked output: path as the user wrote it, full its absolute form, kind one of KINDS,
    noun ("the checkpoint"), origin the option it came from ("--save"; "" for the train block,
    then span is its line), exists whether a file is there now, ident its (st_dev, st_ino) then
    (None when there was none): the one file a run may replace without checking it again."""

    path: str
    full: str
    kind: str
    noun: str
    origin: str
    span: Span | None
    exists: bool
    ident: tuple[int, int, int, int] | None = None

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


# The names streamsched keeps next to an output live in the leaf module `auxnames` (the
# checkpoint writer needs them too, and must not import this module back).


def is_reserved_name(name: str) -> bool:
    """Whether a file name is one streamsched keeps for its own files (a lock, a temporary file):
    no output may have it, so none can be another output's lock or temporary file."""
    return name.endswith(LOCK_SUFFIX) or bool(_TEMP_NAME.match(name))


# ---------------------------------------------------------------------------------------------
# The check before any work


def check_output(path, kind: str, *, noun: str, origin: str = "", span: Span | None = None,
                 inputs: Iterable[tuple[str, str]] = (), append: bool = False,
                 replaceable: Iterable[str] = (), overwrite: bool = False, fits=None) -> Output:
    """Refuse, before any work, an output that cannot be written or must not be (the module
    docstring's policy): a folder, a FIFO, a device, a socket or a symbolic link; a path ending
    in `/`; a reserved name; a file in a folder that does not exist or cannot be written; an
    input (`inputs`: (path, what it is) pairs, e.g. (program, "the program being run")),
    compared by os.path.samefile so a hard link or a path through a linked folder is caught; an
    existing file streamsched did not write as `kind` (see `kind_of`), or that is read-only.
    An empty file holds nothing to lose and may always be used.
    replaceable: inputs this output may be all the same (`--resume ck.npz --save ck.npz`
    continues a checkpoint in place); their content is checked by the reader of that input,
    which reports a broken one precisely (X007), before anything is written.
    overwrite: a checkpoint may replace a checkpoint streamsched wrote that this run does not
    continue (`--overwrite`); fits: for a checkpoint, meta -> whether its arrays fit this run's
    program (then the refusal suggests `--resume` it; else it names it another model's).  append:
    the file grows in place (a log), else it is replaced through a temporary file in its folder.
    Returns the Output; raises StreamschedError X021 (X004 for a path that is not a non-empty
    string)."""
    flag = origin or "`log`"
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise _x("X004", f"{flag} needs a file name, got {'an empty one' if path == '' else repr(path)}"
                 + (" (an unset shell variable?)" if path == "" and origin else ""), span,
                 help=f"e.g. `{origin} {_EXAMPLE[kind]}`" if origin else f'write e.g. `log = "{_EXAMPLE[kind]}"`')
    path = os.fspath(path)
    full = os.path.abspath(os.path.expanduser(path))
    parent = os.path.dirname(full)
    out = Output(path, full, kind, noun, origin, span, False)

    def fail(why: str, help: str) -> StreamschedError:
        return _x("X021", f"cannot write {out.named}: {why}", span, help=help)

    if path.endswith(("/", os.sep)):
        stripped = path.rstrip("/" + os.sep)
        fix = "name a file, not a folder"
        if stripped and os.path.basename(stripped) not in (".", ".."):
            try:
                check_output(stripped, kind, noun=noun, origin=origin, span=span, inputs=inputs, append=append,
                             replaceable=replaceable, overwrite=overwrite, fits=fits)
                fix = f"drop the trailing `/` to write the file `{stripped}`"
            except StreamschedError:
                pass
        raise fail(f"`{path}` ends in `/`, so it names a folder, not a file", fix)
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        st = None
    except OSError as e:  # a path through a file, a name too long...
        raise fail(e.strerror or str(e), "name a file in an existing folder you can write to") from None
    if is_reserved_name(os.path.basename(full)):
        raise fail("the name is one streamsched keeps for its own files next to an output (`.NAME" + LOCK_SUFFIX
                   + "`, `.NAME" + TEMP_INFIX + "XXXXXXXX.tmp`)", "name the output otherwise")
    if st is not None and stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(full)
        try:  # suggest the target only where it could be written in the link's place
            check_output(target, kind, noun=noun, origin=origin, span=span, inputs=inputs, append=append,
                         replaceable=replaceable, overwrite=overwrite, fits=fits)
            fix = f"name the file itself (`{target}`) or a new file"
        except StreamschedError:
            fix = "name a new file"
        raise fail(f"it is a symbolic link (to `{target}`); streamsched does not write through links, so that "
                   "a file the command line does not name is never replaced or grown", fix)
    if st is not None and stat.S_ISDIR(st.st_mode):
        example = os.path.join(path, _EXAMPLE[kind])
        raise fail("it is a folder", f"name a file in it, e.g. `{example}`")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise fail(f"it is {file_kind(st.st_mode)}, not a regular file",
                   "name a regular file (a new one, or one this command wrote before)")
    if not os.path.isdir(parent):
        why = f"the folder `{parent}` does not exist" if not os.path.exists(parent) else f"`{parent}` is not a folder"
        raise fail(why, "create the folder first, or name a file in an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK):  # a new file, a temporary, a lock file
        raise fail(f"the folder `{parent}` is not writable", "name a file in a folder you can write to")
    for aux in (lock_path(full), os.path.join(parent, temp_prefix(full) + "XXXXXXXX" + temp_suffix(full, True))):
        if len(os.fsencode(aux)) >= _path_max(parent):
            raise fail(f"the path is too long for the files streamsched keeps next to it (`{aux}`)",
                       "name a file in a folder with a shorter path")
    keep = [p for p in replaceable if p and os.path.lexists(p)]
    continued = any(same_file(full, k) for k in keep)
    for p, what in inputs:
        if p and os.path.lexists(p) and same_file(full, p) and not continued:
            raise fail(f"it is {what}", "name another file; streamsched never overwrites what a run reads")
    if st is not None and st.st_size > 0 and not continued:
        ok, what = kind_of(full, kind)
        if not ok:
            raise fail(f"it is {what}" + ("" if "did not write" in what else f", not {_KIND_NOUN[kind]}"),
                       f"{_KIND_RULE[kind]}; name a new file (or move this one away)")
        if kind == "checkpoint" and not overwrite:
            busy = OutputLock(out, {}).holder_now()
            if busy is not None:  # a live run writes it: that is the news (X009), not its kind
                raise busy
            from streamsched.interp.checkpoint import checkpoint_meta

            meta = checkpoint_meta(full) or {}
            same = fits is None or bool(fits(meta))
            why = "which this run does not continue" if same else "whose arrays do not fit this program (another model)"
            cont = f"continue it with `--resume {path}`, " if same else ""
            raise fail(f"it holds {what}, {why}; a new run never replaces trained weights without being told to",
                       f"{cont}name a new file, or replace it on purpose with `--overwrite`")
    if st is not None:
        if not st.st_mode & 0o222 or not os.access(full, os.W_OK):
            verb = "append to" if append else "replace"
            raise fail(f"the file is read-only (mode {stat.S_IMODE(st.st_mode):04o})" if not st.st_mode & 0o222 else
                       "the file is not writable by you",
                       f"streamsched does not {verb} a file you protected; make it writable (`chmod u+w {path}`) or "
                       "name another file")
    return Output(path, full, kind, noun, origin, span, st is not None, file_stamp(st) if st is not None else None)


def _path_max(folder: str) -> int:
    try:
        return int(os.pathconf(folder, "PC_PATH_MAX"))
    except (OSError, ValueError, AttributeError):
        return 4096


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


_EXAMPLE = {"checkpoint": "run.npz", "log": "run.jsonl", "plan": "plan.txt", "graph": "plan.svg",
            "trace": "trace.json", "picture": "timeline.png"}
_KIND_NOUN = {
    "checkpoint": "a checkpoint streamsched wrote",
    "log": "a log streamsched wrote",
    "plan": "a plan `streamsched lower` wrote",
    "graph": "a drawing streamsched wrote",
    "trace": "a trace streamsched wrote",
    "picture": "a picture streamsched wrote",
}
_KIND_RULE = {
    "checkpoint": "a checkpoint only replaces a checkpoint streamsched wrote",
    "log": "a log only appends to a log streamsched wrote",
    "plan": "`lower -o` only replaces a plan it wrote (its first line says `# written by streamsched`)",
    "graph": "`graph -o` only replaces a drawing streamsched wrote (marked `written by streamsched`)",
    "trace": "`trace -o` only replaces a trace streamsched wrote (marked `written by streamsched`)",
    "picture": "a picture only replaces a picture streamsched wrote (marked `written by streamsched`)",
}
_PNG = b"\x89PNG\r\n\x1a\n"
_TRACE_MARK = re.compile(rb'^\s*\{\s*"otherData"\s*:\s*\{\s*"written_by"\s*:\s*"streamsched ')


def kind_of(full: str, kind: str) -> tuple[bool, str]:
    """Whether the non-empty regular file `full` is an output of `kind` that streamsched wrote
    (reading at most 64 KiB, the last KiB of a PDF, or a checkpoint's metadata): a checkpoint by
    its metadata (checkpoint.written_by_us), a log by its first line (a JSON object with `epoch`
    and `train_loss`), every other kind by its mark (`mark_file`).  Returns (yes, what it is)."""
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
    ours = False
    if kind == "plan":
        ours = head.startswith(f"# {MARK} ".encode())
    elif kind in ("graph", "picture"):
        if ext in (".dot", ".gv"):
            ours = head.startswith(f"// {MARK} ".encode())
        elif ext == ".svg":
            ours = b"<svg" in head and f"<!-- {MARK} ".encode() in head[:4096]
        elif ext == ".png":
            ours = _png_marked(head)
        elif ext == ".pdf":
            ours = head.startswith(b"%PDF-") and f"% {MARK} ".encode() in _tail(full, 1024)
    elif kind == "trace":
        ours = bool(_TRACE_MARK.match(head))
    if ours:
        return True, f"a {kind} streamsched wrote"
    if what.startswith(("a PNG", "an SVG", "a PDF", "a DOT", "a Chrome")):  # the format alone proves nothing
        what += " that streamsched did not write (it has no `written by streamsched` mark)"
    return False, what


def _tail(full: str, n: int) -> bytes:
    try:
        fd = open_regular(full)
    except ReadError:
        return b""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, n, max(0, size - n))
    except OSError:
        return b""
    finally:
        os.close(fd)


def _png_marked(head: bytes) -> bool:
    """Whether a PNG's chunks before its image data hold our tEXt mark."""
    if not head.startswith(_PNG):
        return False
    pos, want = 8, b"Comment\0" + MARK.encode()
    while pos + 8 <= len(head):
        n = struct.unpack(">I", head[pos:pos + 4])[0]
        typ = head[pos + 4:pos + 8]
        if typ in (b"IDAT", b"IEND"):
            return False
        if typ == b"tEXt" and head[pos + 8:pos + 8 + n].startswith(want):
            return True
        pos += 12 + n
    return False


def _describe(head: bytes) -> str:
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "a zip archive (an .npz?)"
    if head.startswith(b"\x93NUMPY"):
        return "a NumPy .npy array"
    if head.startswith(_PNG):
        return "a PNG picture"
    if head.startswith(b"%PDF-"):
        return "a PDF document"
    if head.startswith(b"\x1f\x8b"):
        return "a gzip file"
    stripped = head.lstrip()
    if stripped.startswith((b"digraph", b"strict digraph", b"graph", b"//", b"/*")) and b"{" in head:
        return "a DOT graph"
    if b"<svg" in head[:4096]:
        return "an SVG picture"
    if stripped.startswith(b"{") and b'"traceEvents"' in head:
        return "a Chrome trace"
    try:
        head.decode("utf-8")
        return "a text file"
    except UnicodeDecodeError as e:
        return "a text file" if e.start > len(head) - 4 else "a binary file"


def mark_file(tmp: str, kind: str, ext: str) -> None:
    """Put streamsched's mark (`kind_of` looks for it) into the finished temporary file `tmp` of
    an output of `kind` (plan, graph, trace, picture; ext: the output's suffix, which chose the
    format), so that the next command may replace it and no one else's file.  The marks keep
    each format valid: a comment line (plan, DOT), an XML comment (SVG), a tEXt chunk (PNG), a
    comment after %%EOF (PDF), a JSON key (trace).  A format without a place for a mark is left
    as it is (then it is never replaced).  Raises OSError."""
    ext = ext.lower()
    with open(tmp, "rb") as f:
        data = f.read()
    if kind == "plan":
        data = f"# {STAMP} (streamsched lower)\n".encode() + data
    elif kind in ("graph", "picture") and ext in (".dot", ".gv"):
        data = f"// {STAMP} (streamsched graph)\n".encode() + data
    elif kind in ("graph", "picture") and ext == ".svg":
        comment = f"<!-- {STAMP} -->\n".encode()
        if data.startswith(b"<?xml"):
            cut = data.find(b"?>") + 2
            nl = data[cut:cut + 2].startswith(b"\r\n") and 2 or data[cut:cut + 1] == b"\n" and 1 or 0
            data = data[:cut + nl] + comment + data[cut + nl:]
        else:
            data = comment + data
    elif kind in ("graph", "picture") and ext == ".png" and data.startswith(_PNG) and len(data) >= 33:
        end = 8 + 12 + struct.unpack(">I", data[8:12])[0]  # IHDR comes first
        body = b"Comment\0" + STAMP.encode("latin-1")
        chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body) & 0xFFFFFFFF)
        data = data[:end] + chunk + data[end:]
    elif kind in ("graph", "picture") and ext == ".pdf":
        data = data + (b"" if data.endswith(b"\n") else b"\n") + f"% {STAMP}\n".encode()
    elif kind == "trace":
        try:
            doc = json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return
        if not isinstance(doc, dict):
            return
        other = doc.pop("otherData", None)
        other = {"written_by": f"streamsched {__version__}", **(other if isinstance(other, dict) else {})}
        data = json.dumps({"otherData": other, **doc}).encode()
    else:
        return
    with open(tmp, "wb") as f:
        f.write(data)


# ---------------------------------------------------------------------------------------------
# Atomic replacement of outputs other than checkpoints


@contextmanager
def replaced(out: Output) -> Iterator[str]:
    """A temporary path next to `out` (with its suffix, for writers that choose the format by it)
    to write the whole output to; on success it is marked (`mark_file`) and replaces `out`
    (checkpoint.replace_atomically), on failure it is removed and `out` is untouched.  Raises
    OSError as atomic_temp."""
    from streamsched.interp.checkpoint import _unlink_quietly, atomic_temp, replace_atomically

    fd, tmp = atomic_temp(out.full, keep_suffix=True)
    os.close(fd)
    try:
        yield tmp
        mark_file(tmp, out.kind, os.path.splitext(out.full)[1])
        replace_atomically(tmp, out.full)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def remove_stale_temps(full: str) -> list[str]:
    """Remove the temporary files a killed run left next to `full` (temp_pattern; regular files
    only; no output may have such a name, so none is a user's).  Call it holding `full`'s lock,
    so no live run's temporary is taken.  Returns the names removed."""
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


def file_stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells one state of a file from another: (st_dev, st_ino, st_size, st_mtime_ns).  A
    file copied over another in place (`cp mine ck.npz`) keeps the inode, not the size and time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(out: Output, expect: tuple | None, ours=None, help: str = "move that file away, then run "
                    "again") -> bool:
    """Before a run writes `out` again (each epoch): the path must still name the file as the
    run left it, `expect` (file_stamp: the file it wrote last, or the one it was allowed to
    replace at the start), or a file `ours(path)` recognises as the run's own (a checkpoint of
    this run, copied back), or nothing.  Returns True when it does, False when the file is gone
    (deleted or moved: writing it anew loses nothing).  Raises StreamschedError X021 when
    something else is there now (a user's file moved or copied onto it: it is never replaced)."""
    try:
        st = os.lstat(out.full)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise _x("X021", f"cannot write {out.named}: {e.strerror or e}", out.span,
                 help="name a file in an existing folder you can write to") from None
    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o222:
        if expect is not None and file_stamp(st) == tuple(expect):
            return True
        if ours is not None and ours(out.full):
            return True
    if stat.S_ISREG(st.st_mode):
        try:
            what = _describe(read_head(out.full, 4096)) if st.st_size else "an empty file"
        except ReadError:
            what = "a file"
        if not st.st_mode & 0o222:
            what += " made read-only"
    else:
        what = file_kind(st.st_mode)
    raise _x("X021", f"cannot write {out.named}: it changed during the run (it is now {what}, not the file this "
             "run wrote); it is left as it is and the run stops", out.span, help=help)


# ---------------------------------------------------------------------------------------------
# Runs: ids, locks, logs


def new_run_id() -> str:
    """A run's id: its start time and 4 random hex digits, `20250101-120000-3fa2` (sortable,
    short enough to grep a log for)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


_O = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


class OutputLock:
    """An advisory lock (fcntl.flock, exclusive, non-blocking) on an output, held through the
    file `lock_path(out.full)`, whose content names the holder as JSON (`streamsched_lock`, pid,
    host, run, started, command, and the output file's identity).  A lock file is made anew or
    taken over only when it is one streamsched wrote (a user's file there is X021 and is left as
    it is); the holder removes it on release; a run that was killed leaves it behind unlocked,
    and the next run takes it over.  `hold_file` also locks the output file itself (a log), so a
    second name for it (a hard link) is refused too.  Where fcntl is missing (Windows) nothing
    is locked."""

    def __init__(self, out: Output, holder: dict):
        self.out = out
        self.holder = holder
        self.path = lock_path(out.full)
        self.fd: int | None = None
        self.file_fd: int | None = None
        self.file_ident: tuple[int, int] | None = None

    def _fail(self, why: str, help: str) -> StreamschedError:
        return _x("X021", f"cannot write {self.out.named}: {why}", self.out.span, help=help)

    def acquire(self) -> None:
        """Take the lock or raise StreamschedError X009 naming the run that holds it (X021 when the
        lock file cannot be made or written, or a file streamsched did not write is at its path;
        nothing is left behind then)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover (Windows)
            return
        for _ in range(10):  # a holder may remove the file between our open and our flock: retry
            created = True
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O, 0o644)
            except FileExistsError:
                created = False
                try:
                    fd = os.open(self.path, os.O_RDWR | _O)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise self._cannot(e) from None
            except OSError as e:
                raise self._cannot(e) from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise self._fail(f"its lock file `{self.path}` is {file_kind(st.st_mode)}, not a regular file",
                                 "remove it, or name another output")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    self._drop(fd, created)
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
            if not created:
                try:
                    raw = os.pread(fd, 65536, 0)
                except OSError:
                    raw = b""
                if raw.strip() and not _is_holder(raw):
                    os.close(fd)
                    raise self._fail(f"a file that streamsched did not write is at `{self.path}`, where it keeps "
                                     "this output's lock; it is left as it is",
                                     "move that file away, or name another output")
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(self.holder) + "\n").encode(), 0)
            except OSError as e:
                self._drop(fd, True)  # ours in any case now: a half-written holder helps no one
                raise self._cannot(e) from None
            self.fd = fd
            return
        raise _x("X009", f"{self.out.named} is in use: its lock kept changing hands", self.out.span)  # pragma: no cover

    def holder_now(self) -> StreamschedError | None:
        """X009 naming the run that holds this lock now, or None when none does (without taking
        it: a shared, non-blocking flock on the existing lock file, released at once)."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover (Windows)
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | _O)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return self._busy(_read_holder(fd))
            return None
        finally:
            os.close(fd)
        return None

    def _cannot(self, e: OSError) -> StreamschedError:
        what = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a folder"}.get(e.errno)
        if what is None and os.path.lexists(self.path) and not os.path.isfile(self.path):
            what = "not a regular file"
        if what is not None:  # something of the user's is where the lock goes: left as it is
            return self._fail(f"its lock file `{self.path}` is {what}, not one streamsched made; it is left as it is",
                              "move it away, or name another output")
        return self._fail(f"cannot make its lock file `{self.path}` ({e.strerror or e})",
                          f"streamsched keeps a `.NAME{LOCK_SUFFIX}` file next to a checkpoint or log while a run "
                          "writes it; free space, or name a file in a folder you can write to")

    def _drop(self, fd: int, created: bool) -> None:
        if created:
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(self.path)
            except OSError:
                pass
        os.close(fd)

    def hold_file(self, fd: int | None = None) -> None:
        """Also lock the output file itself (a log, which is appended to in place, so its inode
        is the file): through `fd` (the open log), else by opening the existing file; nothing
        when there is none yet.  Raises StreamschedError X009 when another run holds it, under
        another name (a hard link) since the path lock was ours."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover (Windows)
            return
        if self.file_fd is not None:
            return
        own = fd is None
        if own:
            try:
                fd = os.open(self.out.full, os.O_RDONLY | _O)
            except OSError:
                return  # nothing there yet: the log's own descriptor is locked once it is made
        st = os.fstat(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if own:
                os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return
            info = _find_holder(os.path.dirname(self.out.full), (st.st_dev, st.st_ino))
            raise self._busy(info, other_name=True) from None
        if not own:
            fd = os.dup(fd)  # the lock lives with the open file description, which the dup shares
        self.file_fd, self.file_ident = fd, (st.st_dev, st.st_ino)
        if self.fd is not None:
            try:  # name the file in the holder record, so a run refused through a hard link finds us
                rec = dict(self.holder, file=[st.st_dev, st.st_ino])
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, (json.dumps(rec) + "\n").encode(), 0)
            except OSError:
                pass

    def _busy(self, info: dict, other_name: bool = False) -> StreamschedError:
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
        how = "; it is the same file as another name that run writes (a hard link)" if other_name else ""
        return _x("X009", f"{self.out.named} is in use by another run ({holder}){how}", self.out.span,
                  help=f"wait for that run to finish{stop}, or give this run another file with {flag}")

    def release(self) -> None:
        if self.file_fd is not None:
            os.close(self.file_fd)
            self.file_fd = None
        if self.fd is None:
            return
        try:  # while still holding it: a waiter sees the inode change and retries
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _is_holder(raw: bytes) -> bool:
    try:
        info = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(info, dict) and "streamsched_lock" in info


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8", errors="replace") or "{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _find_holder(folder: str, ident: tuple[int, int]) -> dict:
    """The holder record of the lock file in `folder` that names the file `ident`, or {}."""
    try:
        names = [n for n in os.listdir(folder) if n.endswith(LOCK_SUFFIX)]
    except OSError:
        return {}
    for n in names:
        try:
            fd = os.open(os.path.join(folder, n), os.O_RDONLY | _O)
        except OSError:
            continue
        try:
            info = _read_holder(fd)
        finally:
            os.close(fd)
        if info.get("file") == list(ident):
            return info
    return {}


def holder_info(run_id: str, command: list[str] | None = None) -> dict:
    """What a lock file says of the run holding it."""
    return {"streamsched_lock": 1, "run": run_id, "pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S%z"), "command": command or []}


def open_log(out: Output):
    """Open the log `out` for appending, as text: never following a symbolic link, never blocking
    (a FIFO put there since the check is refused), and only a regular file.  A last line that a
    killed run left unfinished is ended first, so the next record starts on its own line.
    Raises StreamschedError X021."""
    flags = os.O_APPEND | os.O_CREAT | _O
    try:
        try:  # readable too, so the run can tell its log from a file copied over it (train.log_is_ours)
            fd = os.open(out.full, os.O_RDWR | flags, 0o644)
        except PermissionError:
            fd = os.open(out.full, os.O_WRONLY | flags, 0o644)
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
            rfd = os.open(out.full, os.O_RDONLY | _O)
            try:
                last = os.pread(rfd, 1, st.st_size - 1)
            finally:
                os.close(rfd)
            if last != b"\n":
                f.write("\n")
        except OSError:
            pass
    return f
