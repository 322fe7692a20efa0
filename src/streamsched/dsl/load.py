"""Reading `.sched` sources: the user's file, its `include`s (resolved relative to the including
file, recursion rejected), and the stdlib `ops.sched`.  Returns ASTs plus diagnostics.
"""

from __future__ import annotations

import os
from functools import lru_cache
from importlib import resources

from streamsched.diagnostics import Diagnostic, Label, SourceCache, StreamschedError
from streamsched.dsl import ast as A
from streamsched.dsl.parse import parse
from streamsched.interp.ir import Span

STDLIB_PATH = "<stdlib>/ops.sched"


@lru_cache(maxsize=1)
def stdlib_text() -> str:
    return resources.files("streamsched.stdlib").joinpath("ops.sched").read_text(encoding="utf-8")


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


def load_program_files(path: str, text: str | None, sources: SourceCache) -> tuple[list[A.File], list[Diagnostic]]:
    """Parse `path` (or the given `text` for it) and, depth first, every file it includes.

    A file included more than once (twice, or by two includers) is read the first time only.
    Returns the files in include order (an included file before the rest of its includer) and
    the diagnostics: P-family from parsing (P005 a file that is not UTF-8), S010 include not found,
    S011 recursive include.
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
                with open(p, "rb") as f:
                    raw = f.read()
            except OSError as exc:
                if inc_span is None:
                    raise StreamschedError([Diagnostic("X002", f"cannot read `{p}`: {exc.strerror or exc}")]) from None
                why = "not found" if not os.path.exists(p) else f"cannot be read: {exc.strerror or exc}"
                diags.append(Diagnostic("S010", f"included file `{p}` {why}", inc_span,
                                        help="include paths are relative to the including file"))
                return
            try:
                txt = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is dropped
            except UnicodeDecodeError as exc:
                diags.append(_not_utf8(p, raw, exc, inc_span, sources))
                return
        sources.texts[p] = txt
        try:
            f = parse(txt, p)
        except StreamschedError as e:
            diags.extend(e.diagnostics)
            return
        rest = []
        for item in f.items:
            if isinstance(item, A.Include):
                target = os.path.join(os.path.dirname(p), item.path)
                visit(target, None, chain + (key,), item.span)
            else:
                rest.append(item)
        files.append(A.File(p, tuple(rest)))

    visit(path, text, (), None)
    return files, diags
