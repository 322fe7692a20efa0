"""Golden event plans: the `streamsched lower` text of every example under every policy is pinned
in tests/golden/plans/EXAMPLE.POLICY.txt (with `--no-fuse`: every per-parameter task its own
launch, the plans as they were before the fusion pass) and EXAMPLE.POLICY.fused.txt (the default:
the fusion pass's multi_tensor launches).  A change to dependency analysis or barrier insertion
shows up here as a diff to review (`pytest tests/test_golden_plans.py --update-golden`)."""

from __future__ import annotations

import glob
import os

import pytest

from streamsched.diagnostics import SourceCache
from streamsched.interp.plan_text import format_plan
from streamsched.pipeline import compile_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "plans")
EXAMPLES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "examples", "*.sched")))
CASES = [(e, p, f) for e in EXAMPLES for p in ("auto", "chain", "explicit") for f in (False, True)]


@pytest.mark.parametrize("example,policy,fuse", CASES)
def test_plan_text_is_pinned(example, policy, fuse, request, monkeypatch):
    monkeypatch.chdir(ROOT)
    sources = SourceCache()
    c = compile_file(os.path.join("examples", example), policy=policy, sources=sources, fuse=fuse)
    assert c.plan is not None
    text = format_plan(c.plan, sources)
    codes = sorted({d.code for d in c.diagnostics})
    text += f"\n# diagnostics: {', '.join(codes) if codes else 'none'} ({len(c.diagnostics)})\n"
    path = os.path.join(GOLDEN, f"{example[:-6]}.{policy}{'.fused' if fuse else ''}.txt")
    if request.config.getoption("--update-golden"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    assert os.path.exists(path), f"missing golden {path}: run with --update-golden and review it"
    with open(path, encoding="utf-8") as f:
        assert text == f.read()


def test_auto_is_clean_and_chain_reports_the_seed_race():
    path = os.path.join(ROOT, "examples", "five_streams.sched")
    auto = compile_file(path, policy="auto", capture="step")
    chain = compile_file(path, policy="chain", capture="step")
    assert auto.ok
    # Inside one captured step, the seed's chain policy waits on the representative stream
    # (dX on comp3) only: the optimizer on update then races with the dW kernel (comp1) it reads.
    msgs = [d.message for d in chain.diagnostics if d.code == "R001"]
    assert msgs
    assert any("linear.backward" in m and ".dw" in m and "comp1" in m and "on update" in m for m in msgs), msgs
    # Under capture = graphs every graph joins its streams before its end, so the same
    # schedule is safe: the race is a property of the chain inside one capture unit.
    assert compile_file(path, policy="chain", capture="graphs").ok
