"""Reading `.sched` sources: the user's file, its `include`s (resolved relative to the including
file, recursion rejected), and the stdlib `ops.sched`.  Returns ASTs plus diagnostics.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from importlib import resources

from streamsched.diagnostics import Diagnostic, Label, SourceCache, StreamschedError
from streamsched.dsl import ast as A
from streamsched.dsl.parse import parse
from streamsched.interp.ir import Span
from streamsched.reads import SOURCE_LIMIT, ReadError, human_size, read_regular

from streamsched.stdlib.ops_source import STDLIB_PATH, stdlib_text  # noqa: F401  (re-exported)


@lru_cache(maxsize=1)
def stdlib_file() -> A.File:
    """The parsed stdlib (its spans name `<stdlib>/ops.sched`)."""
    return parse(stdlib_text(), STDLIB_PATH)


def _not_utf8(path: str, raw: bytes, exc: UnicodeDecodeError, inc_span, sources: SourceCache) -> Diagnostic:
    """P005 at the first byte that is not UTF-8; the text is kept (undecodable bytes replaced)
    so the diagnostic can show the line."""
    sources.texts[path] = raw.decode("utf-8", errors="replace")
    pos = exc.start
    line = raw.count(b"\n", 0, pos) + 1
    line_start = raw.rfind(b"\n", 0, pos) + 1
    col = len(raw[line_start:pos].decode("utf-8", errors="replace")) + 1
    labels = (Label(inc_span, "included here"),) if inc_span is not None else ()
    return Diagnostic("P005", f"`{path}` is not UTF-8 text: byte 0x{raw[pos]:02x} at line {line}, column {col}",
                      Span(path, line, col, line, col + 1), labels=labels,
                      help="save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 FILE`)")


def _unreadable(path: str, exc: ReadError, inc_span) -> Diagnostic:
    """The diagnostic for a .sched file that cannot be read: X014 over the size limit; otherwise
    X002 for the program named on the command line, S010 at the `include` line for an include
    (missing, a folder, a FIFO or device: only regular files are read, so `include "/dev/zero"`
    or a FIFO never hangs or fills memory)."""
    if exc.why == "too_large":
        return Diagnostic("X014", f"`{path}` {exc.message}", inc_span,
                          help=f"a .sched file may hold at most {human_size(SOURCE_LIMIT)}; split it or check the path")
    if inc_span is None:
        msg = f"cannot read `{path}`: it {exc.message}" if exc.why != "unreadable" else f"`{path}` {exc.message}"
        return Diagnostic("X002", msg, help="check the path; streamsched reads programs from regular .sched files")
    why = "not found" if exc.why == "missing" else exc.message
    return Diagnostic("S010", f"included file `{path}` {why}", inc_span,
                      help="include paths are relative to the including file, and name a regular .sched file")


def load_program_files(path: str, text: str | None, sources: SourceCache) -> tuple[list[A.File], list[Diagnostic]]:
    """Parse `path` (or the given `text` for it) and, depth first, every file it includes.

    A file included more than once (twice, or by two includers) is read the first time only.
    Returns the files in include order (an included file before the rest of its includer) and
    the diagnostics: P-family from parsing (P005 a file that is not UTF-8), S010 include not found
    or not a regular file, S011 recursive include, X014 a file over SOURCE_LIMIT.  The top file
    that cannot be read raises StreamschedError X002 (X014 when too large).
    Every text read is stored in `sources` so diagnostics can print it.
    """
    files: list[A.File] = []
    diags: list[Diagnostic] = []
    sources.texts.setdefault(STDLIB_PATH, stdlib_text())
    loaded: set[str] = set()  # a file included twice (or by two includers) is read once

    def visit(p: str, txt: str | None, chain: tuple[str, ...], inc_span) -> None:
        key = os.path.realpath(p)
        if key in chain:
            cycle = " -> ".join(os.path.basename(c) for c in chain + (key,))
            diags.append(Diagnostic("S011", f"recursive include: {cycle}", inc_span,
                                    help="remove one of the `include` lines that form the cycle"))
            return
        if key in loaded:
            return
        loaded.add(key)
        if txt is None:
            try:
                raw = read_regular(p, SOURCE_LIMIT, "a .sched file")
            except ReadError as exc:
                diag = _unreadable(p, exc, inc_span)
                if inc_span is None:
                    raise StreamschedError([diag]) from None
                diags.append(diag)
                return
            try:
                txt = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is dropped
            except UnicodeDecodeError as exc:
                diags.append(_not_utf8(p, raw, exc, inc_span, sources))
                return
            if "\r" in txt:  # old Mac line ends (a lone CR) end lines too, one character for one
                txt = re.sub(r"\r(?!\n)", "\n", txt)
        sources.texts[p] = txt
        try:
            f = parse(txt, p)
        except StreamschedError as e:
            diags.extend(e.diagnostics)
            return
        rest = []
        for item in f.items:
            if isinstance(item, A.Include):
                if "\0" in item.path:  # no file system names such a file (and os.path refuses it)
                    diags.append(Diagnostic("S010", "included file path contains a NUL character", item.span,
                                            help="include paths are relative to the including file, and name a "
                                                 "regular .sched file"))
                    continue
                target = os.path.join(os.path.dirname(p), item.path)
                visit(target, None, chain + (key,), item.span)
            else:
                rest.append(item)
        files.append(A.File(p, tuple(rest)))

    try:
        visit(path, text, (), None)
    finally:
        # visit calls itself through its closure, a reference cycle that would keep every file's
        # tree alive until the cycle collector runs; dropping the name breaks it
        visit = None
    return files, diags
