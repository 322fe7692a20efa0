"""Weight tying (dsl/model.py `tie`, dsl/backward.py): a `param` given at a call as an earlier
line's parameter is that parameter; its misuses are diagnostics at the argument."""

from __future__ import annotations

import os

import pytest

from streamsched.pipeline import check_file, compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = open(os.path.join(ROOT, "examples", "gpt_text.sched"), encoding="utf-8").read()
LINE = "    logits = linear(nf, 256)"


def _write(tmp_path, logits_line: str) -> str:
    assert LINE in SRC
    p = tmp_path / "t.sched"
    p.write_text(SRC.replace(LINE, logits_line))
    return str(p)


def test_a_tied_table_is_one_parameter_and_one_gradient_sum(tmp_path):
    c = compile_file(_write(tmp_path, "    logits = unembed(nf, table = tok.table)"))
    assert c.ok, c.diagnostics
    assert [n for n in c.program.model.params if "table" in n] == ["tok.table", "h0.table"]
    sums = [t for t in c.schedule.tasks if t.kernel == "accumulate" and "grad.tok.table" in t.outs]
    assert sums and all(t.args == ("d(tok.table)#1", "d(tok.table)#2") for t in sums)
    assert len([t for t in sums if t.step == sums[0].step]) == 1  # per step: embedding's + projection's
    untied = compile_file(_write(tmp_path, "    logits = unembed(nf, vocab = 256)"))
    assert untied.ok and "logits.table" in untied.program.model.params


@pytest.mark.parametrize("line,code,needle", [
    ("    logits = unembed(nf, table = nope.table)", "S015", "nope.table"),
    ("    logits = unembed(nf, table = nf)", "S015", "nf)"),
    ("    logits = unembed(nf, table = n1.gamma)", "S003", "n1.gamma"),
    ("    logits = unembed(nf, tabel = tok.table)", "S015", "tabel"),
])
def test_tying_mistakes_are_diagnostics_at_the_argument(tmp_path, line, code, needle):
    path = _write(tmp_path, line)
    ds = [d for d in check_file(path) if d.severity == "error"]
    assert [d.code for d in ds] == [code], ds
    text = open(path, encoding="utf-8").read().splitlines()
    ln = next(i for i, t in enumerate(text, 1) if t.startswith("    logits"))
    assert ds[0].span.line == ln and ds[0].span.col == text[ln - 1].index(needle) + 1
