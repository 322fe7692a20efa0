"""The kernel families (src/streamsched/stdlib/kernels/): every record lives in exactly one family
module and names its own CUDA twin there (`<module>:<name>_cuda`), every twin path resolves with
CuPy unimportable (its import deferred into the twins), every record has a doc row matching its
parameters, and the table generator and its command do what docs/kernels.md says."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from streamsched.stdlib.kernel_record import DocRow
from streamsched.stdlib.kernels import FAMILIES, KERNELS, NOT_IN_PLACE, RECIPES, _doc

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def test_every_record_is_in_exactly_one_family_and_names_its_twin_there():
    seen: dict[str, str] = {}
    for fam in FAMILIES:
        assert fam.kernels, fam.module
        for name, rec in fam.kernels.items():
            assert name not in seen, (name, seen.get(name), fam.module)
            seen[name] = fam.module
            assert rec.name == name and rec.cuda == f"{fam.module}:{name}_cuda", name
    assert list(seen) == list(KERNELS)
    assert set(NOT_IN_PLACE) == {n for n, k in KERNELS.items() if not k.inplace}
    assert RECIPES == {n: k.grad for n, k in KERNELS.items() if k.grad is not None}


def test_every_cuda_twin_resolves_without_cupy():
    """In a fresh interpreter where `import cupy` raises, import each record's `cuda` module and
    look its function up: nothing imports CuPy on the way, and every path names a callable."""
    code = textwrap.dedent("""
        import importlib, sys
        sys.modules["cupy"] = None          # `import cupy` now raises ImportError
        from streamsched.stdlib.kernels import KERNELS
        bad = []
        for name, rec in KERNELS.items():
            mod, _, attr = rec.cuda.partition(":")
            try:
                fn = getattr(importlib.import_module(mod), attr)
                if not callable(fn):
                    bad.append(f"{name}: {rec.cuda} is not callable")
            except Exception as exc:
                bad.append(f"{name}: {rec.cuda}: {type(exc).__name__}: {exc}")
        assert sys.modules["cupy"] is None
        print("\\n".join(bad))
        sys.exit(1 if bad else 0)
    """)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_cuda_kernels_is_what_the_paths_name():
    import importlib

    from streamsched.stdlib.kernels import CUDA_KERNELS

    for name, rec in KERNELS.items():
        mod, _, attr = rec.cuda.partition(":")
        assert CUDA_KERNELS[name] is getattr(importlib.import_module(mod), attr), name


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_record_has_a_doc_row_that_names_its_parameters(name):
    _doc.check_row(KERNELS[name])


def test_a_row_that_does_not_match_its_record_is_refused():
    rec = KERNELS["matmul"]
    for sig in ("a [m,k] -> c [m,n]", "b [k,n], a [m,k] -> c", "a, b -> c, d", "a, b => c"):
        with pytest.raises(ValueError, match="matmul"):
            _doc.check_row(dataclasses.replace(rec, row=DocRow(sig, "comp1", "c = a b")))
    with pytest.raises(ValueError, match="required attribute 'ta'"):
        _doc.check_row(dataclasses.replace(rec, row=DocRow("a, b -> c", "comp1", "c", required=("ta",))))
    with pytest.raises(ValueError, match="no doc row"):
        _doc.check_row(dataclasses.replace(rec, row=None))
    assert _doc._split("x [..., c], gamma [c]") == ["x", "gamma"] and _doc._split("()") == []


def test_attribute_cells():
    assert _doc.attrs_text(KERNELS["conv2d_grad_x"]) == "stride=1, pad=0, in_h, in_w (required)"
    assert _doc.attrs_text(KERNELS["conv2d_grad_w"]) == "kh, kw (required), stride=1, pad=0"
    assert _doc.attrs_text(KERNELS["sum"]) == "axis=none"
    assert _doc.attrs_text(KERNELS["fill"]) == 'value=0.0, shape=[], dtype="f32"'
    assert _doc.attrs_text(KERNELS["adam_step"]) == "beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0"
    assert _doc.attrs_text(KERNELS["sgd_step"]) == "momentum=0.9, weight_decay=0.0, nesterov=false"
    assert _doc.attrs_text(KERNELS["relu"]) == ""
    assert _doc.value_text(2.5e10) == "25000000000.0" and _doc.value_text(1e-300) == "1e-300"


def test_the_table_lists_every_kernel_once_under_its_family():
    table = _doc.render_table()
    rows = [ln for ln in table.splitlines() if ln.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == list(KERNELS)
    for fam in FAMILIES:
        assert f"### {fam.title} (`src/{fam.module.replace('.', '/')}.py`)" in table
    assert _doc._cell("a | b") == "a \\| b"


def test_the_doc_command_rewrites_only_between_the_markers(tmp_path, capsys):
    doc = tmp_path / "kernels.md"
    doc.write_text(f"# before\n\n{_doc.BEGIN}\nstale\n{_doc.END}\n\nafter\n", encoding="utf-8")
    assert _doc.main(["--doc", str(doc), "--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    assert _doc.main(["--doc", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith("# before\n\n" + _doc.BEGIN) and text.endswith(_doc.END + "\n\nafter\n")
    assert "| `conv2d` |" in text and "stale" not in text
    assert _doc.main(["--doc", str(doc), "--check"]) == 0
    plain = tmp_path / "other.md"
    plain.write_text("no markers here\n", encoding="utf-8")
    assert _doc.main(["--doc", str(plain)]) == 2
    assert plain.read_text(encoding="utf-8") == "no markers here\n"  # never touched
    assert _doc.main(["--doc", str(tmp_path / "missing.md")]) == 2
    assert _doc.main([]) == 2


def test_the_docs_example_of_adding_a_kernel_is_a_working_record():
    """docs/kernels.md, "Adding a stdlib kernel": its softplus records, run in elementwise.py's
    namespace, register, match their rows, compute softplus, and its gradient kernel agrees with
    central differences; the CUDA names it uses exist in that module."""
    import numpy as np

    from streamsched.stdlib.kernels import elementwise
    from streamsched.stdlib.kernels._base import Family

    text = open(os.path.join(os.path.dirname(SRC), "docs", "kernels.md"), encoding="utf-8").read()
    snippet = text[text.index("def _softplus_cpu"):text.index("# ... and in the module's CUDA part")]
    fam = Family(elementwise.__name__, "softplus")
    exec(snippet, {**vars(elementwise), "_register": fam.register})
    assert list(fam.kernels) == ["softplus", "softplus_grad"]
    for rec in fam.kernels.values():
        _doc.check_row(rec)
    x = np.linspace(-30.0, 30.0, 61)

    def softplus(v):
        y = np.zeros_like(v)
        fam.kernels["softplus"].cpu([v], [y], {})
        return y

    np.testing.assert_allclose(softplus(x), np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x))), rtol=1e-12)
    dx = np.zeros_like(x)
    fam.kernels["softplus_grad"].cpu([np.ones_like(x), x], [dx], {})
    np.testing.assert_allclose(dx, (softplus(x + 1e-6) - softplus(x - 1e-6)) / 2e-6, atol=1e-6)
    for name in ("_unary_cuda", "_binary_cuda", "_PREAMBLE", "_kernels"):
        assert hasattr(elementwise, name), name
