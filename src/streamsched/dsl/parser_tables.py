"""The LALR parser of `grammar/sched.lark`, loaded from tables built ahead and stored beside the
grammar (`grammar/sched_tables.json`) instead of being built by lark in every process (building
takes ~0.3 s, loading ~0.02 s); the tables are used only when they were built from the very
grammar text and lark version at hand, else the parser is built from the grammar as before.

    python -m streamsched.dsl.parser_tables      # rewrite the tables after editing the grammar

The stored form is lark's own serialization (`Lark.memo_serialize`, what its standalone tool
embeds), written as JSON: a tuple is {"\u0000t": [...]}, a dict with keys that are not all
strings is {"\u0000d": [[key, value], ...]}, so that loading gives back exactly what lark wrote.
"""

from __future__ import annotations

import hashlib
import json
import sys
from importlib import resources
from pathlib import Path

import lark
from lark import Lark
from lark.grammar import Rule
from lark.lexer import TerminalDef

OPTIONS = {"parser": "lalr", "propagate_positions": True, "maybe_placeholders": True}
"""How `parse` wants the grammar built (one place, so the tables and a fresh build agree)."""

TABLES = "sched_tables.json"
_TUPLE, _DICT = "\u0000t", "\u0000d"


def grammar_text() -> str:
    return resources.files("streamsched.grammar").joinpath("sched.lark").read_text(encoding="utf-8")


def fingerprint(text: str) -> str:
    """What the tables must have been built from: the grammar text, lark's version, OPTIONS."""
    key = json.dumps([text, lark.__version__, sorted(OPTIONS.items())])
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def build_parser(text: str | None = None) -> Lark:
    """The parser built by lark from the grammar (slow: LALR analysis)."""
    return Lark(grammar_text() if text is None else text, **OPTIONS)


def _encode(x):
    if isinstance(x, tuple):
        return {_TUPLE: [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _encode(v) for k, v in x.items()}
        return {_DICT: [[_encode(k), _encode(v)] for k, v in x.items()]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"parser tables: cannot store a {type(x).__name__}")


def _decode(d: dict):
    if _TUPLE in d and len(d) == 1:
        return tuple(d[_TUPLE])
    if _DICT in d and len(d) == 1:
        return {k: v for k, v in d[_DICT]}
    return d


def tables_text(parser: Lark, text: str) -> str:
    """The JSON text of `parser`'s tables, stamped with the fingerprint of `text`."""
    data, memo = parser.memo_serialize([TerminalDef, Rule])
    return json.dumps({"fingerprint": fingerprint(text), "data": _encode(data), "memo": _encode(memo)},
                      sort_keys=True, separators=(",", ":")) + "\n"


def load_parser() -> Lark:
    """The parser: from the stored tables when they match the grammar and lark at hand, else
    built from the grammar.  Never raises for a missing, stale or unreadable table file."""
    text = grammar_text()
    try:
        raw = resources.files("streamsched.grammar").joinpath(TABLES).read_text(encoding="utf-8")
        stored = json.loads(raw, object_hook=_decode)
        if stored.get("fingerprint") == fingerprint(text):
            return Lark._load_from_dict(stored["data"], stored["memo"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no usable tables: build (the test suite keeps the stored ones fresh)
    return build_parser(text)


def main() -> int:
    text = grammar_text()
    out = Path(str(resources.files("streamsched.grammar").joinpath(TABLES)))
    out.write_text(tables_text(build_parser(text), text), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
