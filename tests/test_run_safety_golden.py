"""Golden run-time mistakes: every file in tests/golden/run_errors is a program that checks clean
(or, for a train-block output, that `check` refuses as `run` does) and that `streamsched run`
refuses with the `# error: [CODE]` markers of its lines, no more, no fewer; a `# run: ARGS` line
gives extra command-line arguments.  Runs happen in a copy of the folder, so nothing in the
repository is written."""

from __future__ import annotations

import os
import re
import shlex
import shutil

import pytest

from safety_helpers import assert_untouched, main, snapshot

HERE = os.path.join(os.path.dirname(__file__), "golden", "run_errors")
FILES = sorted(f for f in os.listdir(HERE) if f.endswith(".sched"))
MARK = re.compile(r"#\s*error:\s*\[([A-Z]\d{3})\]")


def _markers(path: str) -> set[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        return {(i, m.group(1)) for i, line in enumerate(f.read().splitlines(), 1) for m in MARK.finditer(line)}


def _reported(err: str) -> set[tuple[int, str]]:
    out = set()
    lines = err.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"error\[([A-Z]\d{3})\]", line)
        if m and i + 1 < len(lines) and lines[i + 1].startswith(" --> "):
            out.add((int(lines[i + 1].rsplit(":", 2)[1]), m.group(1)))
    return out


@pytest.mark.parametrize("name", FILES)
def test_golden_run_error(name, tmp_path, capsys, monkeypatch):
    for f in os.listdir(HERE):
        shutil.copy(os.path.join(HERE, f), tmp_path / f)
    monkeypatch.chdir(tmp_path)
    text = open(name, encoding="utf-8").read()
    extra = shlex.split(next((ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("# run:")), ""))
    expected = _markers(name)
    assert expected, f"{name} has no `# error: [CODE]` marker"
    before = snapshot(tmp_path)
    rc, out, err = main(capsys, "run", name, "--backend", "cpu", "-q", *extra)
    assert rc == 1 and _reported(err) == expected, err
    assert_untouched(before, tmp_path)
    rc_check, _, err_check = main(capsys, "check", name)
    if any(code == "X021" for _, code in expected):  # a train-block output: `check` says it too
        assert rc_check == 1 and _reported(err_check) == expected
    else:
        assert rc_check == 0, err_check


def test_enough_run_time_mistakes():
    codes = {c for f in FILES for _, c in _markers(os.path.join(HERE, f))}
    assert {"X003", "X010", "X014", "X021"} <= codes
