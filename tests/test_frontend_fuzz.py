"""Random text and random token-level mutations of the examples (deleted, duplicated, swapped
tokens) never produce a Python traceback from the front end: only diagnostics or success."""

from __future__ import annotations

import glob
import os
import re

from hypothesis import given, settings, strategies as st

from streamsched.diagnostics import StreamschedError, render_all
from streamsched.dsl.resolve import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {os.path.basename(p): open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(ROOT, "examples", "*.sched")))}
TOKEN = re.compile(r"\s+|#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d*)?|\^T|->|\"[^\"\n]*\"|.", re.S)


def _front_end(text: str, name: str = "fuzz.sched") -> None:
    try:
        resolve(os.path.join(ROOT, "examples", name), text)
    except StreamschedError as e:
        assert e.diagnostics
        for d in e.diagnostics:
            assert re.fullmatch(r"[PSCRX]\d{3}", d.code), d.code
        render_all(e.diagnostics)  # rendering must not fail either


@settings(max_examples=500)
@given(st.text(alphabet=st.sampled_from(list("streams{}op()->on:=,.[]^T#\n modelgraphstep train x y 0123 f32 i32 \"")), max_size=200))
def test_random_text_never_crashes(text):
    _front_end(text)


@settings(max_examples=200)
@given(st.text(max_size=120))
def test_arbitrary_unicode_never_crashes(text):
    _front_end(text)


def _tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


@st.composite
def mutated(draw):
    name = draw(st.sampled_from(sorted(EXAMPLES)))
    toks = _tokens(EXAMPLES[name])
    words = [i for i, t in enumerate(toks) if t.strip() and not t.startswith("#")]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["delete", "duplicate", "swap", "replace"]))
        i = draw(st.sampled_from(words))
        if kind == "delete":
            toks[i] = ""
        elif kind == "duplicate":
            toks[i] = toks[i] + " " + toks[i]
        elif kind == "swap":
            j = draw(st.sampled_from(words))
            toks[i], toks[j] = toks[j], toks[i]
        else:
            toks[i] = toks[draw(st.sampled_from(words))]
    return name, "".join(toks)


@settings(max_examples=2000)
@given(mutated())
def test_mutated_examples_never_crash(case):
    name, text = case
    _front_end(text, name)
