"""Golden negative tests: every file in tests/golden/errors is a user mistake with inline
`# error: [CODE]` markers on the line where the caret must point (ruff/ty style); the checker
must report exactly those (code, line) pairs, no more, no fewer.  Some renderings are pinned
in tests/golden/errors/*.txt (regenerate with `pytest --update-golden`, then review the diff).
"""

from __future__ import annotations

import os
import re

import pytest

from streamsched.diagnostics import SourceCache, render_all
from streamsched.pipeline import check_file

HERE = os.path.join(os.path.dirname(__file__), "golden", "errors")
FILES = sorted(f for f in os.listdir(HERE) if f.endswith(".sched"))
MARK = re.compile(r"#\s*error:\s*\[([A-Z]\d{3})\]")
INCLUDE = re.compile(r'^\s*include\s+"([^"]+)"', re.M)


def _markers(path: str) -> set[tuple[str, int, str]]:
    out = set()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for i, line in enumerate(text.splitlines(), 1):
        for m in MARK.finditer(line):
            out.add((os.path.basename(path), i, m.group(1)))
    for inc in INCLUDE.findall(text):
        p = os.path.join(os.path.dirname(path), inc)
        if p.endswith(".inc") and os.path.exists(p):
            out |= _markers(p)
    return out


def test_enough_distinct_mistakes():
    codes = {c for f in FILES for (_, _, c) in _markers(os.path.join(HERE, f))}
    assert len(FILES) >= 25
    for family in "PSCR":
        assert any(c.startswith(family) for c in codes), family


@pytest.mark.parametrize("name", FILES)
def test_golden_error(name):
    path = os.path.join(HERE, name)
    expected = _markers(path)
    assert expected, f"{name} has no `# error: [CODE]` marker"
    diags = check_file(path)
    got = {(os.path.basename(d.span.file), d.span.line, d.code) for d in diags if d.span is not None}
    rendered = render_all(diags, SourceCache())
    assert got == expected, rendered
    for d in diags:
        assert d.severity == "error"
        assert d.message and "Traceback" not in d.message


PINNED = ["s004_float_labels", "r001_inplace_race_explicit", "p001_unclosed_brace", "s003_shape_mismatch",
          "c002_host_value_in_graph"]


@pytest.mark.parametrize("name", PINNED)
def test_rendered_text_pinned(name, request):
    path = os.path.join(HERE, name + ".sched")
    rel = os.path.relpath(path, os.path.dirname(os.path.dirname(HERE)))
    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.dirname(HERE)))
    try:
        text = render_all(check_file(rel), SourceCache())
    finally:
        os.chdir(cwd)
    golden = os.path.join(HERE, name + ".txt")
    if request.config.getoption("--update-golden"):
        with open(golden, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    with open(golden, encoding="utf-8") as f:
        assert text + "\n" == f.read()
