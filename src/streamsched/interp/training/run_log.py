"""The run's JSON-lines log: opened for appending and locked through its inode, one line per
epoch, appended only while the path still names the file this run wrote (a log deleted or moved
is made anew with a note; another file put there is X021 and kept)."""

from __future__ import annotations

import json
import os
import stat
from typing import Callable

from streamsched.diagnostics import StreamschedError
from streamsched.interp.training.options import _with_help, _x
from streamsched.outputs import Output, check_unchanged, open_log


class RunLog:
    """The log `out` of one run.  echo: where the note of a log made anew goes; kept: the
    `; the checkpoint ... holds epoch N: resume with ...` tail of an error that stops the run
    (Checkpoints.kept).  lock: the run's OutputLock of the log, re-held when the log is made anew."""

    def __init__(self, out: Output, echo: Callable[[str], None], kept: Callable[[], str], lock=None):
        self.out, self.echo, self.kept, self.lock = out, echo, kept, lock
        self.f = None
        self.ident: tuple[int, int] | None = None  # the file this run appends to
        self.head = b""
        self.size = 0

    @property
    def path(self) -> str:
        return self.out.path

    def open(self) -> None:
        """Open the log for appending and lock it through its inode (a second name for it, a hard
        link, is refused to other runs)."""
        self.f = open_log(self.out)
        fd = self.f.fileno()
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)
        self.head = b""
        self.f.flush()  # (a newline that ends a killed run's last line)
        self.seen()
        if self.lock is not None and self.lock.file_ident != self.ident:
            if self.lock.file_fd is not None:  # the file the lock held is not the one opened
                os.close(self.lock.file_fd)
                self.lock.file_fd = None
            self.lock.hold_file(fd)

    def write(self, rec: dict) -> None:
        """Append `rec` to the log, which must still be the file this run opened (outputs.
        check_unchanged): a log deleted or moved away is made anew, with a note; another file put
        at its path is X021 and left as it is."""
        if self.f is None:
            return
        try:
            if not self.is_ours():
                self.f.close()
                self.f = None
                self.open()
                self.echo(f"note: the log `{self.out.path}` was deleted or moved during the run; a new one there "
                          f"holds the records from epoch {rec['epoch']} on")
            self.f.write(json.dumps(rec) + "\n")
            self.f.flush()
            self.seen()
        except StreamschedError as e:
            kept = self.kept()
            raise StreamschedError([_with_help(d, kept.replace("; the checkpoint", ", then resume: the checkpoint", 1))
                                    for d in e.diagnostics]) from None
        except OSError as exc:
            raise _x("X021", f"cannot write the log `{self.out.path}`: {exc.strerror or exc}", self.out.span,
                     help="the lines written before are kept; free space or name another file" + self.kept()) from None

    def seen(self) -> None:
        """Note the log as this run left it: its size and its first bytes (log_is_ours)."""
        fd = self.f.fileno()
        self.size = os.fstat(fd).st_size
        if len(self.head) < 256:
            try:
                self.head = os.pread(fd, 256, 0)
            except OSError:  # a log this user may write but not read: its size and inode only
                self.head = b""

    def is_ours(self) -> bool:
        """Whether the log path still names the file this run appends to, as it left it (the same
        inode, not shorter, the same first bytes: another file copied over it in place is not);
        False when it is gone (deleted or moved: made anew).  Raises StreamschedError X021 when
        another file is there."""
        fd = self.f.fileno()
        st = os.fstat(fd)
        head = self.head
        expect = (st.st_dev, st.st_ino)
        try:
            now = os.lstat(self.out.full)
        except FileNotFoundError:
            return False
        except OSError:
            now = None
        same = now is not None and (now.st_dev, now.st_ino) == expect and stat.S_ISREG(now.st_mode)
        if same and st.st_size >= self.size:
            try:
                if os.pread(fd, len(head), 0) == head:
                    return True
            except OSError:
                return True
        # another file is there, or this one was rewritten: never appended to
        return check_unchanged(self.out, None, help="move that file away")  # X021 naming it (False: gone now)

    def close(self, report: bool = False) -> None:
        """Close the log; report: a failure to close it (a full disk shows at the last flush) is
        X021, else (another error already on its way) it is dropped."""
        if self.f is not None:
            f, self.f = self.f, None
            try:
                f.close()
            except OSError as exc:
                if report:
                    raise _x("X021", f"cannot write the log `{self.out.path}`: {exc.strerror or exc}", self.out.span,
                             help="the lines written before are kept; free space or name another file") from None
