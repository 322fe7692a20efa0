"""A help line that suggests a fix must be a fix: every diagnostic that carries a mechanical fix
(diagnostics.Fix) is applied to its file, and the result must parse and no longer have that
diagnostic.  Run over every golden error file and over the examples checked under the policies
that make them report races (`explicit`, `chain`)."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from streamsched.diagnostics import Fix, apply_fixes
from streamsched.interp.ir import Span
from streamsched.pipeline import check_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "errors")
EXAMPLES = os.path.join(ROOT, "examples")


def _key(d, path: str) -> tuple:
    """What identifies a finding across the edit: code, line and message without file names
    (an inserted clause shifts columns on its own line only)."""
    return d.code, d.span.line if d.span else 0, d.message.replace(path, "F")


def _fixed_cases():
    cases = []
    for name in sorted(os.listdir(GOLDEN)):
        if name.endswith(".sched"):
            cases.append((os.path.join(GOLDEN, name), None))
    for name in ("explicit_mlp.sched", "five_streams.sched", "mlp_digits.sched", "inplace_backward.sched"):
        for policy in ("explicit", "chain"):
            cases.append((os.path.join(EXAMPLES, name), policy))
    return cases


def _copy_dir(src_path: str, tmp_path) -> str:
    """A copy of the file in a fresh folder with its includes beside it."""
    folder = os.path.dirname(src_path)
    for f in os.listdir(folder):
        if f.endswith(".inc"):
            shutil.copy(os.path.join(folder, f), tmp_path / f)
    dst = tmp_path / os.path.basename(src_path)
    shutil.copy(src_path, dst)
    return str(dst)


@pytest.mark.parametrize("path,policy", _fixed_cases(), ids=lambda v: os.path.basename(v) if isinstance(v, str) else str(v))
def test_every_suggested_fix_parses_and_removes_its_diagnostic(path, policy, tmp_path):
    here = _copy_dir(path, tmp_path)
    diags = check_file(here, policy=policy)
    with open(here, encoding="utf-8") as f:
        text = f.read()
    fixed_any = False
    seen_fixes = set()
    for d in diags:
        if not d.fixes:
            continue
        if any(fx.span.file != here for fx in d.fixes):
            continue  # a fix in an included file is checked where that file is the golden one
        fixes = tuple(d.fixes)
        if fixes in seen_fixes:
            continue  # many races share one fix (one clause orders them all): apply it once
        seen_fixes.add(fixes)
        fixed_any = True
        out = tmp_path / ("fixed_" + os.path.basename(path))
        out.write_text(apply_fixes(text, fixes), encoding="utf-8")
        after = check_file(str(out), policy=policy)
        assert not any(a.code.startswith("P") for a in after), (d.message, [a.message for a in after])
        before_keys = [_key(x, here) for x in diags if _same_fix(x, fixes)]
        after_keys = {_key(a, str(out)) for a in after}
        assert not set(before_keys) & after_keys, (d.help, fixes, [a.message for a in after if _key(a, str(out)) in set(before_keys)])
        # and it breaks nothing else: no new kind of error (a cycle hides the races behind it,
        # so fixing an R002 may reveal R001s; nothing else may appear)
        new = {a.code for a in after if a.severity == "error"} - {x.code for x in diags}
        assert new <= ({"R001"} if d.code == "R002" else set()), (d.help, sorted(new), [a.message for a in after if a.code in new][:3])
    if os.path.basename(path).startswith(("r001", "r002", "r005")):
        assert fixed_any, "every race, cycle and lifetime golden file offers a fix"


def _same_fix(d, fixes) -> bool:
    return tuple(d.fixes) == fixes


def test_apply_fixes_inserts_replaces_and_refuses_overlaps():
    text = "a = relu(x)\nb = add(a, x) after a\n"
    f = "f"
    assert apply_fixes(text, [Fix(Span(f, 1, 12, 1, 12), " after z")]) == "a = relu(x) after z\nb = add(a, x) after a\n"
    assert apply_fixes(text, [Fix(Span(f, 2, 14, 2, 22), "")]) == "a = relu(x)\nb = add(a, x)\n"
    assert apply_fixes(text, [Fix(Span(f, 1, 1, 1, 2), "c"), Fix(Span(f, 2, 1, 2, 2), "d")]).startswith("c = relu")
    with pytest.raises(ValueError):
        apply_fixes(text, [Fix(Span(f, 1, 1, 1, 5), ""), Fix(Span(f, 1, 3, 1, 8), "")])
    with pytest.raises(ValueError):
        apply_fixes(text, [Fix(Span(f, 9, 1, 9, 2), "")])


def test_launch_race_help_is_a_valid_step_statement():
    """`load after prev.pass` is not a statement; the help quotes the launch as written."""
    path = os.path.join(EXAMPLES, "five_streams.sched")
    helps = {d.help for d in check_file(path, policy="explicit") if d.code == "R001"}
    launch_helps = [h for h in helps if h.startswith("order the launches in the step")]
    assert launch_helps
    for h in launch_helps:
        stmt = re.search(r"`([^`]+)`", h).group(1)
        assert re.match(r"^(upload \w+( on \w+)?|\w+(\[\w+\])?(\(\w+\[\w+\]\))?) after [\w.]+(, [\w.]+)*$", stmt), h
    assert any("load[next] after prev.pass" in h for h in launch_helps)
