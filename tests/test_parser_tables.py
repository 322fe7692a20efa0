"""The stored LALR tables (grammar/sched_tables.json) are the ones in use, and the parser loaded
from them parses every .sched file of the repository, and reports every syntax error, exactly as
a parser lark builds from the grammar now."""

from __future__ import annotations

import glob
import json
import os

import pytest
from lark.exceptions import UnexpectedInput

import streamsched.dsl.parser_tables as T
from streamsched.dsl import parse as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(set(glob.glob(os.path.join(ROOT, "examples", "**", "*.sched"), recursive=True)
                   + glob.glob(os.path.join(ROOT, "tests", "**", "*.sched"), recursive=True)
                   + glob.glob(os.path.join(ROOT, "src", "streamsched", "stdlib", "*.sched"))))


@pytest.fixture(scope="module")
def parsers():
    return T.load_parser(), T.build_parser()


def test_stored_tables_match_the_grammar():
    path = os.path.join(ROOT, "src", "streamsched", "grammar", T.TABLES)
    with open(path, encoding="utf-8") as f:
        stored = json.load(f)
    assert stored["fingerprint"] == T.fingerprint(T.grammar_text()), \
        "grammar/sched.lark (or lark) changed: run `python -m streamsched.dsl.parser_tables`"
    assert T.load_parser().source_path == "<deserialized>"  # loaded, not rebuilt


def _outcome(parser, text: str, path: str):
    try:
        return ("tree", parser.parse(text))
    except UnexpectedInput as exc:
        d = P._parse_error(exc, text, path)
        return ("error", d.code, d.message, d.span, d.help)


def _mutants(text: str):
    """The file, cut short at a few places, and with a stray character: syntax errors of every kind."""
    yield text
    for frac in (0.25, 0.5, 0.9):
        yield text[: int(len(text) * frac)]
    mid = len(text) // 2
    yield text[:mid] + " ) " + text[mid:]
    yield text[:mid] + " $ " + text[mid:]


def test_loaded_parser_behaves_like_a_fresh_build(parsers):
    loaded, built = parsers
    assert len(FILES) > 20
    errors = 0
    for path in FILES:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for t in _mutants(text):
            got, want = _outcome(loaded, t, path), _outcome(built, t, path)
            assert got == want, path
            errors += got[0] == "error"
    assert errors > len(FILES)  # the mutants did reach the error paths


def test_stale_or_missing_tables_fall_back_to_building(monkeypatch):
    monkeypatch.setattr(T, "fingerprint", lambda text: "not the stored one")
    p = T.load_parser()
    assert p.source_path != "<deserialized>"
    assert p.parse("streams { a : compute }\n") is not None
    monkeypatch.setattr(T, "TABLES", "no_such_tables.json")
    assert T.load_parser().source_path != "<deserialized>"
