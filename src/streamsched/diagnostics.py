"""Diagnostics as data: a stable code, a message, a primary span, labelled secondary spans and
help, rendered in the ruff/rustc form or as JSON (STYLE.md, habit 4).

Families (LANGUAGE.md): P parse, S names/types/shapes, R races/cycles/waits, C capture rules,
X run time (data, devices).  A code never changes meaning; `docs/errors.md` lists them all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from streamsched.interp.ir import Span
from streamsched.stdlib.ops_source import STDLIB_PATH, stdlib_text

RENDER_LIMIT = 16 * 2 ** 20
"""Characters of a source file the renderer reads to show its lines (the loader's limit)."""


@dataclass(frozen=True)
class Label:
    """A secondary span with a short note, printed under the primary one."""

    span: Span
    message: str


@dataclass(frozen=True)
class Fix:
    """A mechanical edit that a diagnostic's help describes: replace the text of `span` (end
    exclusive; an empty span inserts) with `text`.  `apply_fixes` performs it; the suite applies
    every fix of its golden files and checks the result parses and loses that diagnostic."""

    span: Span
    text: str


@dataclass(frozen=True)
class Diagnostic:
    """One user-facing finding.  severity is "error" or "warning"; span may be None for
    findings with no source position (a missing data file named on the command line).
    fixes: the edits the help suggests, when it suggests one (all in one file, applied together)."""

    code: str
    message: str
    span: Span | None = None
    help: str = ""
    labels: tuple[Label, ...] = ()
    severity: str = "error"
    notes: tuple[str, ...] = ()
    fixes: tuple[Fix, ...] = ()

    def sort_key(self) -> tuple:
        s = self.span
        return (s.file, s.line, s.col, self.code) if s else ("", 0, 0, self.code)

    def to_json(self) -> dict:
        def sp(s: Span | None):
            if s is None:
                return None
            return {"file": s.file, "line": s.line, "col": s.col, "end_line": s.end_line, "end_col": s.end_col}

        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "span": sp(self.span),
            "help": self.help,
            "labels": [{"span": sp(l.span), "message": l.message} for l in self.labels],
            "notes": list(self.notes),
            "fixes": [{"span": sp(f.span), "text": f.text} for f in self.fixes],
        }


def apply_fixes(text: str, fixes) -> str:
    """`text` with every Fix applied (spans are 1-based line/column, end exclusive, all in this
    text).  Raises ValueError for overlapping fixes or a span outside the text."""
    lines = text.split("\n")
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln) + 1)

    def offset(line: int, col: int) -> int:
        if not 1 <= line <= len(lines) or not 1 <= col <= len(lines[line - 1]) + 1:
            raise ValueError(f"position {line}:{col} is outside the text")
        return starts[line - 1] + col - 1

    edits = sorted(((offset(f.span.line, f.span.col), offset(f.span.end_line, f.span.end_col), f.text)
                    for f in fixes), reverse=True)
    for (a, b, _), (c, _d, _t) in zip(edits[1:], edits):
        if b > c:
            raise ValueError("overlapping fixes")
    for a, b, t in edits:
        text = text[:a] + t + text[b:]
    return text


class StreamschedError(Exception):
    """Raised to stop a pass on user mistakes; carries the diagnostics that explain them."""

    def __init__(self, diagnostics: list[Diagnostic] | tuple[Diagnostic, ...]):
        self.diagnostics = tuple(diagnostics)
        super().__init__("; ".join(f"{d.code}: {d.message}" for d in self.diagnostics))


class InternalError(Exception):
    """A bug in streamsched itself (never a user mistake); names the pass that broke."""


@dataclass
class SourceCache:
    """File name -> text, so the renderer can print source lines."""

    texts: dict[str, str] = field(default_factory=dict)

    def line(self, file: str, line: int) -> str | None:
        text = self.texts.get(file)
        if text is None and file == STDLIB_PATH:
            text = self.texts[file] = stdlib_text()
        if text is None:
            try:  # a file that is not UTF-8 is reported by the loader; show what can be shown
                if not os.path.isfile(file):  # a FIFO or a device would block or never end
                    return None
                with open(file, encoding="utf-8", errors="replace") as f:
                    text = f.read(RENDER_LIMIT)  # (the loader refused larger files already)
            except OSError:
                return None
            self.texts[file] = text
        lines = text.splitlines()
        if 1 <= line <= len(lines):
            return lines[line - 1]
        if line == len(lines) + 1:
            return ""
        return None


SHOWN_COLUMNS = 200
"""The most characters of a source line a diagnostic shows (a window around the caret, with
`...` where it is cut)."""


def _snippet(span: Span, sources: SourceCache, message: str = "", gutter: int = 0) -> list[str]:
    src = sources.line(span.file, span.line)
    if src is None:
        return []
    num = str(span.line)
    width = max(gutter, len(num))
    start = max(span.col, 1)
    if span.end_line == span.line and span.end_col > span.col:
        end = span.end_col
    else:
        end = max(len(src) + 1, start + 1)
    if len(src) > SHOWN_COLUMNS:  # a 10 000-character line would bury the message: show a window
        lo = max(0, start - 1 - SHOWN_COLUMNS // 4)
        hi = lo + SHOWN_COLUMNS
        left, right = ("..." if lo else ""), ("..." if hi < len(src) else "")
        src = left + src[lo:hi] + right
        start, end = start - lo + len(left), min(end, hi + 1) - lo + len(left)
    carets = "^" * max(1, end - start)
    pad = " " * width
    tail = f" {message}" if message else ""
    # Columns count characters, a tab as one; a terminal widens tabs.  Keep the source's tabs
    # in the caret line's indent (everything else a space) so the caret stays under its column.
    indent = "".join("\t" if ch == "\t" else " " for ch in src[:start - 1]) + " " * max(0, start - 1 - len(src))
    return [f"{pad} |", f"{num.rjust(width)} | {src}", f"{pad} | {indent}{carets}{tail}"]


def render(diag: Diagnostic, sources: SourceCache | None = None) -> str:
    """Render one diagnostic::

        error[R001]: race on buffer `x` between comp1 and comp3
         --> model.sched:12:5
          |
        12 |     dx = matmul(dy, w^T) on comp3 into x
          |     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^ writes `x`
          = help: add `after dw`
    """
    sources = sources or SourceCache()
    out = [f"{diag.severity}[{diag.code}]: {diag.message}"]
    if diag.span is not None:
        out.append(f" --> {diag.span}")
        out.extend(_snippet(diag.span, sources))
    for lab in diag.labels:
        out.append(f" ::: {lab.span}")
        out.extend(_snippet(lab.span, sources, lab.message))
    for n in diag.notes:
        out.append(f"  = note: {n}")
    if diag.help:
        out.append(f"  = help: {diag.help}")
    return "\n".join(out)


def render_all(diags, sources: SourceCache | None = None, fmt: str = "text") -> str:
    """All diagnostics sorted by position; fmt "text" or "json"."""
    ds = sorted(diags, key=Diagnostic.sort_key)
    if fmt == "json":
        return json.dumps([d.to_json() for d in ds], indent=2)
    sources = sources or SourceCache()
    body = "\n\n".join(render(d, sources) for d in ds)
    n_err = sum(1 for d in ds if d.severity == "error")
    n_warn = sum(1 for d in ds if d.severity == "warning")
    summary = []
    if n_err:
        summary.append(f"{n_err} error{'s' if n_err != 1 else ''}")
    if n_warn:
        summary.append(f"{n_warn} warning{'s' if n_warn != 1 else ''}")
    return body + ("\n\n" + ", ".join(summary) + " found" if summary else "")
