"""Kernels written in Python (`--kernels MODULE`, streamsched.kernel_api): the example module's
records join one program's table, its recipe derives the backward of an op built on it (checked
against finite differences), and every way a module can be wrong is an X015 diagnostic with exit
status 1, never a traceback.  A `.sched` kernel may not take a module kernel's name (S028)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from streamsched import cli
from streamsched.kernel_api import ENTRY_POINT_GROUP, KernelModules, kernel, load_kernel_modules
from streamsched.diagnostics import StreamschedError
from streamsched.interp.train import TrainOptions, train
from streamsched.pipeline import compile_file
from streamsched.stdlib.kernel_record import KernelTypeError
from streamsched.stdlib.kernels import KERNELS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KDIR = os.path.join(ROOT, "examples", "kernels")
LN = os.path.join(KDIR, "layer_norm_mlp.sched")


@pytest.fixture
def modpath(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(KDIR)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in list(sys.modules):
        if name.startswith("ssk_") or name == "row_norm_kernels":
            del sys.modules[name]
    return tmp_path


def test_example_module_loads_and_trains(modpath):
    mods = load_kernel_modules(["row_norm_kernels"])
    assert set(mods) == {"row_norm", "row_norm_grad"} and mods.origins["row_norm"] == "row_norm_kernels"
    c = compile_file(LN, kernels=mods)
    assert c.ok, c.diagnostics
    kernels = [t.kernel for t in c.program.graph("pass").templates]
    assert "row_norm" in kernels and "row_norm_grad" in kernels  # the backward derived from the recipe
    assert "row_norm" not in KERNELS and "row_norm" not in compile_file(
        os.path.join(ROOT, "examples", "mlp_digits.sched")).program.kernels
    res = train(c, TrainOptions(backend="cpu", max_steps=2, progress=False), base_dir=KDIR)
    assert res.steps == 2 and res.races == [] and np.isfinite(res.history[-1]["train_loss"])


def test_example_kernels_match_finite_differences(modpath):
    mods = load_kernel_modules(["row_norm_kernels"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6)) * 2 + 1
    dy = rng.normal(size=(4, 6))
    y = np.zeros_like(x)
    mods["row_norm"].cpu([x], [y], {})
    np.testing.assert_allclose(y.mean(axis=-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=-1), 1 / (1 + 1e-5 / x.var(axis=-1)), rtol=1e-9)
    dx = np.zeros_like(x)
    mods["row_norm_grad"].cpu([dy, x], [dx], {})

    def loss():
        out = np.zeros_like(x)
        mods["row_norm"].cpu([x], [out], {})
        return float((dy * out).sum())

    num = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + 1e-6
        fp = loss()
        x[i] = old - 1e-6
        fm = loss()
        x[i] = old
        num[i] = (fp - fm) / 2e-6
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-7)
    with pytest.raises(KernelTypeError) as e:
        mods["row_norm"].infer([((4,), "i32")], {})
    assert e.value.code == "S004"
    with pytest.raises(KernelTypeError):
        mods["row_norm"].infer([((4,), "f32")], {"epsilon": 1.0})  # unknown attribute: checked by kernel()
    with pytest.raises(KernelTypeError):
        mods["row_norm"].infer([((4,), "f32"), ((4,), "f32")], {})  # arity


def test_cli_runs_with_kernels(modpath, capsys, monkeypatch):
    assert cli.main(["check", LN, "--kernels", "row_norm_kernels"]) == 0
    assert cli.main(["check", LN]) == 1  # without the module, row_norm is an unknown kernel
    assert "S014" in capsys.readouterr().err
    monkeypatch.chdir(modpath)
    assert cli.main(["run", LN, "--kernels", "row_norm_kernels", "--backend", "cpu", "--steps", "2", "-q",
                     "--log", str(modpath / "log.jsonl")]) == 0


def _module(modpath, name, text):
    (modpath / f"{name}.py").write_text(text)
    return name


GOOD = """
from streamsched.kernel_api import kernel
def _i(t, a): return [t[0]]
def _c(ins, outs, a): outs[0][...] = ins[0] * 2
KERNELS = [kernel("twice", "x", "y", _i, _c)]
"""


@pytest.mark.parametrize("text,words", [
    (None, "no module of that name"),
    ("import numpy\nraise ValueError('boom')\n", "ValueError: boom (ssk_mod.py:2)"),
    ("import no_such_dependency_x\n", "it imports `no_such_dependency_x`"),
    ("X = 1\n", "defines no `KERNELS`"),
    ("KERNELS = 5\n", "is not a list of kernel records"),
    ("KERNELS = ['relu']\n", "not a kernel record"),
    (GOOD.replace('"twice"', '"relu"'), "`relu`, which is a stdlib kernel"),
    ("import sys\nsys.exit(3)\n", "SystemExit"),
])
def test_bad_modules_are_x015_without_traceback(modpath, capsys, text, words):
    name = "ssk_mod" if text is not None else "ssk_missing"
    if text is not None:
        _module(modpath, name, text)
    with pytest.raises(StreamschedError) as e:
        load_kernel_modules([name])
    (d,) = e.value.diagnostics
    assert d.code == "X015" and words in d.message, d.message
    assert cli.main(["check", LN, "--kernels", name]) == 1
    err = capsys.readouterr().err
    assert "error[X015]" in err and "Traceback" not in err and err.count("error[") == 1


def test_two_modules_with_one_name_and_a_file_path(modpath, capsys):
    _module(modpath, "ssk_a", GOOD)
    _module(modpath, "ssk_b", GOOD)
    assert set(load_kernel_modules(["ssk_a"])) == {"twice"}
    with pytest.raises(StreamschedError) as e:
        load_kernel_modules(["ssk_a", "ssk_b"])
    assert "`ssk_a` registers too" in e.value.diagnostics[0].message
    with pytest.raises(StreamschedError) as e:
        load_kernel_modules([str(modpath / "ssk_a.py")])
    assert "--kernels ssk_a" in e.value.diagnostics[0].help  # the suggested fix is a valid command line
    assert cli.main(["check", LN, os.path.join(ROOT, "examples", "mlp_digits.sched"), "--kernels", "ssk_zz"]) == 1
    assert capsys.readouterr().err.count("error[X015]") == 1  # reported once for all the files


def test_sched_kernel_may_not_take_a_module_kernels_name(modpath, tmp_path):
    _module(modpath, "ssk_a", GOOD)
    f = tmp_path / "k.sched"
    f.write_text("streams { c : compute }\nkernel twice(x : T[...]) -> y : T[...] { y = 2 * x }\n")
    from streamsched.pipeline import check_file

    (d,) = check_file(str(f), kernels=load_kernel_modules(["ssk_a"]))
    assert d.code == "S028" and "`ssk_a`" in d.message and d.span.line == 2
    assert check_file(str(f)) == ()


def test_entry_points_are_found_by_name(modpath, monkeypatch):
    _module(modpath, "ssk_ep", GOOD)

    class EP:
        name = "doubling"

        def load(self):
            import ssk_ep

            return ssk_ep.KERNELS  # an entry point may name the list itself

    import importlib.metadata as md

    monkeypatch.setattr(md, "entry_points", lambda group=None: [EP()] if group == ENTRY_POINT_GROUP else [])
    mods = load_kernel_modules(["doubling"])
    assert set(mods) == {"twice"} and mods.origins["twice"] == "doubling"


def test_kernel_builder_checks_names_and_fills_defaults():
    seen = {}

    def infer(types, attrs):
        seen.update(attrs)
        return [types[0]]

    k = kernel("f", ["x"], "y", infer, lambda i, o, a: None, attrs={"alpha": 2.0})
    assert k.infer([((3,), "f32")], {}) == [((3,), "f32")] and seen == {"alpha": 2.0}
    assert not k.inplace and k.grad is None
    for bad in ("a-b", "1x", ""):
        with pytest.raises(ValueError):
            kernel(bad, "x", "y", infer, lambda i, o, a: None)
    with pytest.raises(NotImplementedError):
        k.cuda(None, "s", [], [], {})
    assert isinstance(KernelModules(), dict)
