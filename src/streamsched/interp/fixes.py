"""Mechanical fixes for diagnostics (diagnostics.Fix): insert an `after` clause, drop one ref of
an `after` clause, drop an `into` clause, replace a ref.  Each builds an edit that keeps the
statement valid, so a help line that describes it is a fix where it is suggested."""

from __future__ import annotations

from streamsched.diagnostics import Fix
from streamsched.interp.ir import AfterClause, Span


def insert_after(tail: Span, ref: str) -> Fix:
    """Add ` after REF` right after a statement's last token (a statement may carry several
    `after` clauses: they are one list)."""
    return Fix(Span(tail.file, tail.end_line, tail.end_col, tail.end_line, tail.end_col), f" after {ref}")


def _between(a: Span, b: Span) -> Span:
    """From the end of `a` to the end of `b`."""
    return Span(a.file, a.end_line, a.end_col, b.end_line, b.end_col)


def drop_ref(clauses: tuple[AfterClause, ...], ref: str) -> tuple[Fix, ...]:
    """Remove `ref` from the first `after` clause naming it: the whole clause when it is the only
    ref there, else the ref and its comma.  () when no clause names it."""
    for c in clauses:
        names = [t for t, _ in c.refs]
        if ref not in names:
            continue
        i = names.index(ref)
        if len(c.refs) == 1:
            return (Fix(c.span, ""),)
        if i > 0:
            return (Fix(_between(c.refs[i - 1][1], c.refs[i][1]), ""),)
        a, b = c.refs[0][1], c.refs[1][1]
        return (Fix(Span(a.file, a.line, a.col, b.line, b.col), ""),)
    return ()


def drop_clause(span: Span) -> Fix:
    """Remove a clause (`into x`)."""
    return Fix(span, "")


def replace_ref(clauses: tuple[AfterClause, ...], ref: str, text: str) -> tuple[Fix, ...]:
    """Replace the first ref `ref` of the clauses by `text` (`pass` -> `prev.pass`)."""
    for c in clauses:
        for name, span in c.refs:
            if name == ref:
                return (Fix(span, text),)
    return ()
