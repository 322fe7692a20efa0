"""`kernel` forms compiled with SymPy: type rules, the NumPy twin against an independent mpmath
evaluation of the same expression tree, the derived gradients against central finite
differences and against mpmath's own differentiation, reductions, broadcasting, and the CUDA
twin's kernel text (checked on the CPU: its parameter lists, and its device code compiled as C++
and run against the NumPy twin; the GPU comparison is in tests/test_kernel_lang_cuda.py)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import mpmath
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kernel_lang_helpers import StreamschedError, compile_kernels, gradients, run
from streamsched.stdlib.kernel_lang import expr_kernel
from streamsched.stdlib.kernel_record import KernelTypeError

mpmath.mp.dps = 40
EXAMPLES = min(settings().max_examples, 80)  # each example compiles a kernel with SymPy (~20 ms)
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- the type rule and the basic twin -----------------------------------------------------------
SWISH = """
kernel swish(x : T[...]) -> y : T[...] { y = x * sigmoid(x) }
kernel bias_swish(x : T[..., n], b : T[n]) -> y : T[..., n] {
    z = x + b
    y = z * sigmoid(z)
}
kernel leaky(x : T[...], slope = 0.01) -> y : T[...] { y = where(x > 0, x, slope * x) }
kernel rms(x : T[n, k], eps = 0.00001) -> y : T[n] { y = sqrt(mean(x * x, axis = 1) + eps) }
kernel colsum(x : T[...]) -> y : T[...] { y = sum(x, axis = 0) }
kernel total(x : T[...], w : T[...]) -> y : T[] { y = sum(x * w) }
kernel two(x : T[...], y : T[...]) -> (s : T[...], d : T[...]) { s = x + y; d = x - y }
kernel scaled_mean(x : T[n, k], s : T[n]) -> y : T[n] { y = mean(x, axis = -1) * s }
"""


@pytest.fixture(scope="module")
def K():
    return compile_kernels(SWISH)


def test_records_are_kernels_of_the_program_only(K):
    from streamsched.stdlib.kernels import KERNELS

    assert {"swish", "bias_swish", "rms"} <= set(K)
    assert "swish" not in KERNELS and "bias_swish" not in KERNELS
    assert K["swish"].inputs == ("x",) and K["swish"].outputs == ("y",)
    assert K["leaky"].attrs == {"slope": 0.01}
    assert K["swish"].inplace and not K["rms"].inplace
    assert K["swish"].grad is not None and callable(K["swish"].cuda)


def test_type_rules(K):
    assert K["swish"].infer([((4, 3), "f32")], {}) == [((4, 3), "f32")]
    assert K["bias_swish"].infer([((2, 4, 3), "f16"), ((3,), "f16")], {}) == [((2, 4, 3), "f16")]
    assert K["rms"].infer([((5, 7), "f64")], {}) == [((5,), "f64")]
    assert K["colsum"].infer([((5, 7), "f32")], {}) == [((7,), "f32")]
    assert K["total"].infer([((5, 7), "f32"), ((7,), "f32")], {}) == [((), "f32")]
    assert K["scaled_mean"].infer([((5, 7), "f32"), ((5,), "f32")], {}) == [((5,), "f32")]
    with pytest.raises(KernelTypeError) as e:
        K["bias_swish"].infer([((4, 3), "f32"), ((4,), "f32")], {})
    assert e.value.code == "S003" and e.value.arg == 1 and "`n` is 3" in e.value.message
    with pytest.raises(KernelTypeError) as e:
        K["bias_swish"].infer([((4, 3), "f32"), ((3,), "f16")], {})
    assert e.value.code == "S004" and e.value.arg == 1
    with pytest.raises(KernelTypeError) as e:
        K["swish"].infer([((4,), "i32")], {})
    assert e.value.code == "S004"
    with pytest.raises(KernelTypeError) as e:
        K["rms"].infer([((5,), "f32")], {})
    assert e.value.code == "S003" and "2 dimensions" in e.value.message
    with pytest.raises(KernelTypeError) as e:
        K["colsum"].infer([((), "f32")], {})
    assert "out of range" in e.value.message
    with pytest.raises(KernelTypeError) as e:
        K["two"].infer([((4, 3), "f32"), ((2, 3), "f32")], {})
    assert "do not broadcast" in e.value.message
    with pytest.raises(KernelTypeError) as e:
        K["leaky"].infer([((4,), "f32")], {"slop": 1.0})
    assert "unknown attribute 'slop'" in e.value.message
    with pytest.raises(KernelTypeError):
        K["swish"].infer([((4,), "f32"), ((4,), "f32")], {})


def test_numpy_twins_compute_the_formulas(K):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 5)) * 3
    b = rng.normal(size=5)
    sig = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(run(K["swish"], [x])[0], x * sig, rtol=1e-14)
    z = x + b
    np.testing.assert_allclose(run(K["bias_swish"], [x, b])[0], z / (1 + np.exp(-z)), rtol=1e-14)
    np.testing.assert_array_equal(run(K["leaky"], [x], {"slope": 0.2})[0], np.where(x > 0, x, 0.2 * x))
    np.testing.assert_allclose(run(K["rms"], [x])[0], np.sqrt((x * x).mean(axis=1) + 1e-5), rtol=1e-14)
    np.testing.assert_allclose(run(K["colsum"], [x])[0], x.sum(axis=0), rtol=1e-14)
    np.testing.assert_allclose(run(K["total"], [x, b])[0], (x * b).sum(), rtol=1e-13)
    s, d = run(K["two"], [x, b])
    np.testing.assert_array_equal(s, x + b)
    np.testing.assert_array_equal(d, x - b)
    w = rng.normal(size=6)
    np.testing.assert_allclose(run(K["scaled_mean"], [x, w])[0], x.mean(axis=-1) * w, rtol=1e-14)


def test_f16_and_f32_are_computed_in_f32_and_rounded_once(K):
    x = np.linspace(-6, 6, 97).astype(np.float16)
    want = (x.astype(np.float32) / (1 + np.exp(-x.astype(np.float32)))).astype(np.float16)
    (got,) = run(K["swish"], [x])
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)


def test_sigmoid_is_overflow_free_and_accurate(K):
    x = np.array([-800.0, -40.0, -1e-3, 0.0, 1e-3, 40.0, 800.0])
    with np.errstate(all="raise"):
        (y,) = run(K["swish"], [x])
    want = [float(v / (1 + mpmath.exp(-mpmath.mpf(v)))) for v in x]
    np.testing.assert_allclose(y, want, rtol=1e-15, atol=0)


def test_outputs_may_be_the_storage_of_an_input(K):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 3))
    y = rng.normal(size=(4, 3))
    want = run(K["two"], [x, y])
    a, b = x.copy(), y.copy()
    K["two"].cpu([a, b], [a, b], {})  # s into x's storage, d into y's: both computed first
    np.testing.assert_array_equal(a, want[0])
    np.testing.assert_array_equal(b, want[1])


# ---- gradients of the named kernels --------------------------------------------------------------
def _fd(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


@pytest.mark.parametrize("name,shapes,attrs", [
    ("swish", [(4, 3)], {}), ("bias_swish", [(4, 3), (3,)], {}), ("bias_swish", [(2, 3, 4), (4,)], {}),
    ("leaky", [(5,)], {"slope": 0.3}), ("rms", [(4, 6)], {"eps": 0.5}), ("colsum", [(4, 3)], {}),
    ("total", [(4, 3), (3,)], {}), ("total", [(4, 3), ()], {}), ("two", [(4, 3), (4, 1)], {}),
    ("scaled_mean", [(3, 5), (3,)], {})])
def test_derived_gradients_match_finite_differences(K, name, shapes, attrs):
    rng = np.random.default_rng(len(name))
    ins = [np.array(rng.normal(size=s) + 0.1) for s in shapes]
    outs = run(K[name], ins, attrs)
    douts = [np.array(rng.normal(size=o.shape)) for o in outs]

    def loss():
        return sum(float((d * o).sum()) for d, o in zip(douts, run(K[name], ins, attrs)))

    got, parts = gradients(K, name, ins, douts, attrs)
    for x, g in zip(ins, got):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(g, _fd(loss, x), rtol=1e-6, atol=1e-7)


def test_gradient_kernels_are_named_by_input_and_read_what_the_derivative_needs(K):
    x, b = np.ones((4, 3)), np.ones(3)
    _, parts = gradients(K, "bias_swish", [x, b], [np.ones((4, 3))], arg_names=["h", "bias"])
    assert [p.kernel for p in parts] == ["bias_swish.dx", "bias_swish.db"]
    assert parts[0].args == ("dout0", "h", "bias") and parts[1].args == ("dout0", "h", "bias")
    _, parts = gradients(K, "rms", [np.ones((4, 3))], [np.ones(4)], arg_names=["v"])
    # sqrt's slope depends on the mean: the reduced value is recomputed by rms.s
    (p,) = parts
    assert p.kernel == "rms.dx" and p.args[0] == "dout0" and p.args[1].kernel == "rms.s"
    _, parts = gradients(K, "colsum", [np.ones((4, 3))], [np.ones(3)])
    assert parts[0].kernel == "colsum.dx" and parts[0].args == ("dout0", "in0")  # a sum's slope is 1


def test_gradient_of_one_output_of_two(K):
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
    d = rng.normal(size=(3, 2))
    (gx, gy), parts = gradients(K, "two", [x, y], [None, d])
    np.testing.assert_allclose(gx, d)
    np.testing.assert_allclose(gy, -d)
    assert parts[0].kernel == "two.dx@d"


def test_gradient_of_integer_input_is_none():
    K = compile_kernels("kernel pick(x : T[n], m : i32[n]) -> y : T[n] { y = where(m == 1, x, 0) }")
    x, m = np.array([1.0, 2.0, 3.0]), np.array([1, 0, 1], np.int32)
    np.testing.assert_array_equal(run(K["pick"], [x, m])[0], [1.0, 0.0, 3.0])
    (gx, gm), _ = gradients(K, "pick", [x, m], [np.ones(3)])
    np.testing.assert_array_equal(gx, [1.0, 0.0, 1.0])
    assert gm is None


def test_not_differentiable_constructs_raise():
    from streamsched.stdlib.kernel_record import NotDifferentiable

    K = compile_kernels("""
kernel q(x : T[...]) -> y : T[...] { y = floor(x) + x }
kernel s(x : T[...]) -> y : T[...] { y = sign(x) * x }
kernel m(x : T[n, k]) -> y : T[n] { y = max(x, axis = 1) }
kernel a(x : T[...]) -> y : T[...] { y = abs(x) }
""")
    for name, construct in (("q", "floor"), ("s", "sign"), ("m", "max")):
        with pytest.raises(NotDifferentiable) as e:
            gradients(K, name, [np.ones((2, 3))], [np.ones((2, 3)) if name != "m" else np.ones(2)])
        assert e.value.construct == construct
    (g,), _ = gradients(K, "a", [np.array([-2.0, 3.0])], [np.ones(2)])  # abs is fine: sign(x)
    np.testing.assert_array_equal(g, [-1.0, 1.0])


def test_max_min_reductions_forward():
    K = compile_kernels("""
kernel mx(x : T[n, k]) -> y : T[n] { y = max(x, axis = 1) }
kernel mn(x : T[n, k]) -> y : T[k] { y = min(x * 2, axis = 0) - 1 }
""")
    x = np.random.default_rng(0).normal(size=(4, 5))
    np.testing.assert_array_equal(run(K["mx"], [x])[0], x.max(axis=1))
    np.testing.assert_array_equal(run(K["mn"], [x])[0], (2 * x).min(axis=0) - 1)


# ---- diagnostics (the golden files pin one of each; these cover the rest) -------------------------
@pytest.mark.parametrize("body,code,words", [
    ("kernel f(x : T[...]) -> y : T[...] { y = frob(x) }", "S027", "unknown function `frob`"),
    ("kernel f(x : T[...]) -> y : T[...] { y = x * q }", "S007", "unknown name `q`"),
    ("kernel f(x : T[n, k]) -> y : T[...] { y = x * n }", "S007", "is a dimension"),
    ("kernel f(x : T[...]) -> y : T[...] { y = exp(x, x) }", "S005", "takes 1 argument"),
    ("kernel f(x : T[...]) -> y : T[...] { y = sum(x, x) }", "S005", "`sum` takes one expression"),
    ("kernel f(x : T[...]) -> y : U[...] { y = x }", "S004", "`U` is not bound"),
    ("kernel f(x : T[...]) -> y : i32[...] { y = x }", "S004", "outputs are float"),
    ("kernel f(x : T[...], m : f32[...]) -> y { y = x * m }", "S004", "needs a type"),
    ("kernel f(x : T[...]) -> y : T[...] { y = x / 0 }", "S015", "not finite"),
    ("kernel f(x : T[...]) -> y : T[...] { y = sum(x, axis = 0.5) }", "S015", "must be an integer"),
    ("kernel f(x : T[...]) -> y : T[...] { y = sum(x, axs = 1) }", "S015", "no attribute `axs`"),
    ("kernel f(x : T[n, ...]) -> y : T[...] { y = x }", "S015", "comes first"),
    ("kernel f(x : T[...], a = 1 < 2) -> y : T[...] { y = x }", "S015", "constant"),
    ("kernel f(x : T[...]) -> y : T[...] { y = x; y = x }", "S002", "assigned twice"),
    ("kernel f(x : T[...]) -> y : T[...] { x = 1 }", "S002", "cannot be assigned"),
    ("kernel f(x : T[...]) -> y : T[...] { z = x }", "S007", "never assigns its output `y`"),
    ("kernel f(a = 1.0) -> y : T[...] { y = a }", "S005", "no input tensor"),
    ("kernel f(x : T[n, k]) -> y : T[n, k] { y = sum(x, axis = 1) }", "S003", "is 2-D"),
    ("kernel f(x : T[n, k]) -> y : T[n] { y = x + 1 }", "S003", "is 1-D"),
    ("kernel f(x : T[n, k]) -> y : T[m] { y = sum(x, axis = 0) }", "S003", "`m` is not a dimension"),
    ("kernel f(x : T[n, k]) -> y : T[n] { y = sum(sum(x, axis = 1)) }", "S030", "inside"),
    ("kernel f(x : T[n, k]) -> (y : T[n], z : T[n, k]) { y = sum(x, axis = 1); z = x }", "S030",
     "several outputs"),
    ("kernel f(x : T[n, k]) -> y : T[n] { y = sum(x, axis = 1) * sum(x, axis = 1) }", "S030", "reduces twice"),
    ("kernel f(x : T[n]) -> y : T[] { y = sum(2) + x }", "S030", "reduces no input"),
    ("kernel f(x : T[n]) -> y : T[] { y = sum(x) * x }", "S030", "both inside and outside"),
    ("kernel swish(x : T[...]) -> y : T[...] { y = x }\nkernel swish(x : T[...]) -> y : T[...] { y = x }", "S002",
     "defined twice"),
    ("kernel tanh(x : T[...]) -> y : T[...] { y = x }", "S028", "stdlib kernel"),
])
def test_kernel_body_mistakes(body, code, words):
    with pytest.raises(StreamschedError) as e:
        compile_kernels(body)
    d = e.value.diagnostics
    assert [x.code for x in d] == [code], d
    assert words in d[0].message, d[0].message
    assert d[0].span is not None and d[0].span.line >= 1


def test_dtype_variables_and_concrete_dtypes():
    K = compile_kernels("kernel f(x : T[...], w : f32[...]) -> y : T[...] { y = x * w }")
    assert K["f"].infer([((3,), "f64"), ((3,), "f32")], {}) == [((3,), "f64")]
    y = run(K["f"], [np.ones(3), np.full(3, 2, np.float32)])[0]
    assert y.dtype == np.float64 and (y == 2).all()


# ---- random expression trees: the NumPy twin against mpmath, the gradient against FD and mpmath ----
# A tree is ("x",) / ("b",) (an input: x is [m, n], b a row [n]), ("c", value), or (op, children...).
UNARY = ("neg", "exp", "tanh", "sigmoid", "softplus", "erf", "sin", "cos", "abs", "sq", "cube", "log1sq", "sqrt1sq",
         "atan_like")
BINARY = ("add", "sub", "mul", "div1sq", "max", "min")


def trees(depth):
    leaf = st.one_of(st.just(("x",)), st.just(("b",)),
                     st.sampled_from([-1.5, -0.5, 0.25, 0.5, 2.0, 3.0]).map(lambda v: ("c", v)))
    if depth == 0:
        return leaf
    sub = trees(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(st.sampled_from(UNARY), sub),
        st.tuples(st.sampled_from(BINARY), sub, sub),
        st.tuples(st.just("where"), sub, sub, sub, sub),
    )


def text(t) -> str:
    """The kernel-language text of tree t."""
    k = t[0]
    if k in ("x", "b"):
        return k
    if k == "c":
        return repr(t[1])
    a = [text(c) for c in t[1:]]
    return {
        "neg": lambda: f"-({a[0]})", "exp": lambda: f"exp({a[0]})", "tanh": lambda: f"tanh({a[0]})",
        "sigmoid": lambda: f"sigmoid({a[0]})", "softplus": lambda: f"softplus({a[0]})", "erf": lambda: f"erf({a[0]})",
        "sin": lambda: f"sin({a[0]})", "cos": lambda: f"cos({a[0]})", "abs": lambda: f"abs({a[0]})",
        "sq": lambda: f"({a[0]}) ** 2", "cube": lambda: f"({a[0]}) ** 3", "log1sq": lambda: f"log(1 + ({a[0]}) ** 2)",
        "sqrt1sq": lambda: f"sqrt(({a[0]}) * ({a[0]}) + 0.5)", "atan_like": lambda: f"({a[0]}) / (1 + abs({a[0]}))",
        "add": lambda: f"({a[0]}) + ({a[1]})", "sub": lambda: f"({a[0]}) - ({a[1]})", "mul": lambda: f"({a[0]}) * ({a[1]})",
        "div1sq": lambda: f"({a[0]}) / (1 + ({a[1]}) ** 2)", "max": lambda: f"max({a[0]}, {a[1]})",
        "min": lambda: f"min({a[0]}, {a[1]})", "where": lambda: f"where({a[0]} > {a[1]}, {a[2]}, {a[3]})",
    }[k]()


def oracle(t, env):
    """(value, kink) of tree t at env = {"x": mpf, "b": mpf} in mpmath: independent of SymPy and
    of the code under test; kink is the distance to the nearest point where a max, min, abs or
    comparison switches (finite differences there are meaningless)."""
    k = t[0]
    if k in ("x", "b"):
        return env[k], mpmath.inf
    if k == "c":
        return mpmath.mpf(t[1]), mpmath.inf
    vals = [oracle(c, env) for c in t[1:]]
    v = [x for x, _ in vals]
    kink = min(kk for _, kk in vals)
    one = mpmath.mpf(1)
    if k == "abs":
        kink = min(kink, abs(v[0]))
    if k in ("max", "min"):
        kink = min(kink, abs(v[0] - v[1]))
    if k == "atan_like":
        kink = min(kink, abs(v[0]))
    if k == "where":
        kink = min(kink, abs(v[0] - v[1]))
    f = {
        "neg": lambda: -v[0], "exp": lambda: mpmath.exp(v[0]), "tanh": lambda: mpmath.tanh(v[0]),
        "sigmoid": lambda: one / (1 + mpmath.exp(-v[0])), "softplus": lambda: mpmath.log(1 + mpmath.exp(v[0])),
        "erf": lambda: mpmath.erf(v[0]), "sin": lambda: mpmath.sin(v[0]), "cos": lambda: mpmath.cos(v[0]),
        "abs": lambda: abs(v[0]), "sq": lambda: v[0] ** 2, "cube": lambda: v[0] ** 3,
        "log1sq": lambda: mpmath.log(1 + v[0] ** 2), "sqrt1sq": lambda: mpmath.sqrt(v[0] * v[0] + mpmath.mpf(0.5)),
        "atan_like": lambda: v[0] / (1 + abs(v[0])), "add": lambda: v[0] + v[1], "sub": lambda: v[0] - v[1],
        "mul": lambda: v[0] * v[1], "div1sq": lambda: v[0] / (1 + v[1] ** 2),
        "max": lambda: v[0] if v[0] > v[1] else v[1], "min": lambda: v[0] if v[0] < v[1] else v[1],
        "where": lambda: v[2] if v[0] > v[1] else v[3],
    }[k]
    return f(), kink


def magnitude(t, env):
    """The largest |value| of any node of t at env (the scale of the rounding errors)."""
    own = abs(oracle(t, env)[0])
    if t[0] in ("x", "b", "c"):
        return own
    return max([own] + [magnitude(c, env) for c in t[1:]])


def _compile_tree(t):
    return compile_kernels(f"kernel f(x : T[..., n], b : T[n]) -> y : T[..., n] {{ y = {text(t)} }}")


def _points(rng, m=3, n=2):
    return rng.uniform(-1.5, 1.5, size=(m, n)), rng.uniform(-1.5, 1.5, size=n)


@PROPERTY
@given(trees(3), st.integers(0, 2 ** 32 - 1))
def test_numpy_twin_agrees_with_mpmath(t, seed):
    x, b = _points(np.random.default_rng(seed))
    K = _compile_tree(t)
    (y,) = run(K["f"], [x, b])
    for i in np.ndindex(x.shape):
        env = {"x": mpmath.mpf(x[i]), "b": mpmath.mpf(b[i[-1]])}
        want, _ = oracle(t, env)
        scale = 1 + magnitude(t, env)
        assume(scale < 1e30)
        assert abs(y[i] - float(want)) <= 1e-11 * float(scale), (text(t), i, y[i], want)


@PROPERTY
@given(trees(3), st.integers(0, 2 ** 32 - 1))
def test_derived_gradient_agrees_with_finite_differences_and_mpmath(t, seed):
    rng = np.random.default_rng(seed)
    x, b = _points(rng)
    for i in np.ndindex(x.shape):  # keep away from kinks, where no derivative exists
        assume(oracle(t, {"x": mpmath.mpf(x[i]), "b": mpmath.mpf(b[i[-1]])})[1] > 1e-3)
        assume(magnitude(t, {"x": mpmath.mpf(x[i]), "b": mpmath.mpf(b[i[-1]])}) < 1e12)
    K = _compile_tree(t)
    dy = rng.normal(size=x.shape)
    (gx, gb), _ = gradients(K, "f", [x, b], [dy])
    assert gx.shape == x.shape and gb.shape == b.shape

    def loss():
        return float((dy * run(K["f"], [x, b])[0]).sum())

    h = 1e-6
    fx, fb = _fd(loss, x, h), _fd(loss, b, h)
    # exact derivatives by mpmath (at 40 digits), summed over the row for b
    mx = np.zeros_like(x)
    mb = np.zeros_like(b)
    scale = 1.0
    for i in np.ndindex(x.shape):
        xv, bv = mpmath.mpf(x[i]), mpmath.mpf(b[i[-1]])
        scale = max(scale, float(magnitude(t, {"x": xv, "b": bv})))
        mx[i] = float(dy[i] * mpmath.diff(lambda v: oracle(t, {"x": v, "b": bv})[0], xv))
        mb[i[-1]] += float(dy[i] * mpmath.diff(lambda v: oracle(t, {"x": xv, "b": v})[0], bv))
    big = 1 + max(np.abs(mx).max(), np.abs(mb).max())
    np.testing.assert_allclose(gx, mx, rtol=0, atol=1e-9 * big * scale)
    np.testing.assert_allclose(gb, mb, rtol=0, atol=1e-9 * big * scale)
    # central differences in f64: truncation h^2 and rounding eps/h, both far below 1e-5
    np.testing.assert_allclose(gx, fx, rtol=0, atol=1e-5 * big * scale)
    np.testing.assert_allclose(gb, fb, rtol=0, atol=1e-5 * big * scale)


POSTS = {"id": ("S", lambda s: s), "sq": ("S ** 2", lambda s: s * s), "tanh": ("tanh(S)", mpmath.tanh),
         "sqrt": ("sqrt(S ** 2 + 1)", lambda s: mpmath.sqrt(s * s + 1))}
"""Post expressions of the reduced value S (written once: each S is the reduction's text)."""


@PROPERTY
@given(trees(2), st.sampled_from(["sum", "mean"]), st.sampled_from([0, 1, -1]), st.sampled_from(sorted(POSTS)),
       st.integers(0, 2 ** 32 - 1))
def test_reduction_kernels_agree_with_mpmath_and_their_gradients_with_fd(t, kind, axis, post, seed):
    rng = np.random.default_rng(seed)
    x, b = _points(rng, 3, 4)
    ptext, pfun = POSTS[post]
    body = ptext.replace("S", f"{kind}(x + ({text(t)}), axis = {axis})")  # the map reads x: [m, n]
    K = compile_kernels(f"kernel f(x : T[m, n], b : T[n]) -> y {{ y = {body} }}")
    (y,) = run(K["f"], [x, b])
    ax = axis % 2
    vals = np.empty(x.shape, dtype=object)
    for i in np.ndindex(x.shape):
        env = {"x": mpmath.mpf(x[i]), "b": mpmath.mpf(b[i[-1]])}
        assume(magnitude(t, env) < 1e12 and oracle(t, env)[1] > 1e-3)
        vals[i] = env["x"] + oracle(t, env)[0]
    red = vals.sum(axis=ax)
    if kind == "mean":
        red = red / x.shape[ax]
    want = np.array([float(pfun(r)) for r in red])
    scale = 1 + float(max(abs(v) for v in vals.flat))
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-11 * scale * x.shape[ax])
    dy = rng.normal(size=y.shape)
    (gx, gb), _ = gradients(K, "f", [x, b], [dy])

    def loss():
        return float((dy * run(K["f"], [x, b])[0]).sum())

    big = 1 + float(np.abs(_fd(loss, x)).max()) + float(np.abs(_fd(loss, b)).max())
    np.testing.assert_allclose(gx, _fd(loss, x), rtol=0, atol=1e-5 * big * scale)
    np.testing.assert_allclose(gb, _fd(loss, b), rtol=0, atol=1e-5 * big * scale)


# ---- the CUDA twin's text, on the CPU ------------------------------------------------------------
def test_generated_code_holds_no_name_the_user_wrote():
    """Parameters named like the generated code's own names (numpy, s, cnt, a0) or Python and C
    keywords compute what they say: the printed code only knows positional symbols."""
    K = compile_kernels("kernel f(numpy : T[...], s : T[...], cnt : T[...], a0 : T[...], lambda = 2.0) -> "
                        "def : T[...] { def = numpy * s + cnt - a0 * lambda }")
    rng = np.random.default_rng(4)
    ins = [rng.normal(size=5) for _ in range(4)]
    np.testing.assert_allclose(run(K["f"], ins)[0], ins[0] * ins[1] + ins[2] - ins[3] * 2.0, rtol=1e-15)
    from streamsched.stdlib.kernel_lang import numpy_source

    ek = expr_kernel(K["f"])
    allowed = re.compile(r"(a|p|t)\d+|_(a|p|t)\d+|y\d+|s|_s|cnt|_cnt|def|return|numpy|_ss|_out|_map|float|double|"
                         r"const|float32|float64|sigmoid|ss_sigmoid|exp|log|where|sqrt")
    for text in (numpy_source(ek.spec), ek.cuda_source(["f32"] * 4, ["f32"]).operation):
        names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
        assert all(allowed.fullmatch(n) for n in names), sorted(n for n in names if not allowed.fullmatch(n))
        assert "lambda" not in names and "numpy_" not in text


def test_cuda_source_of_an_elementwise_kernel(K):
    src = expr_kernel(K["bias_swish"]).cuda_source(["f32", "f32"], ["f32"])
    assert src.kind == "elementwise"
    assert src.in_params == "float32 a0, float32 a1, float64 p0, float64 cnt".replace("float64 p0, ", "")
    assert src.out_params == "float32 y0"
    assert "const float _a0 = (float)a0;" in src.operation and "y0 = (float)(" in src.operation
    assert "ss_sigmoid(" in src.operation and "__device__" in src.preamble
    assert "double" not in src.operation  # float arithmetic in a float kernel
    s64 = expr_kernel(K["bias_swish"]).cuda_source(["f64", "f64"], ["f64"])
    assert "const double _a0 = (double)a0;" in s64.operation and s64.in_params.startswith("float64 a0")
    s16 = expr_kernel(K["bias_swish"]).cuda_source(["f16", "f16"], ["f16"])
    assert s16.in_params.startswith("float16 a0") and "y0 = (float16)(" in s16.operation
    assert "const float _a0" in s16.operation
    lk = expr_kernel(K["leaky"]).cuda_source(["f32"], ["f32"])
    assert lk.in_params == "float32 a0, float64 p0, float64 cnt" and "const float _p0 = (float)p0;" in lk.operation
    assert "?" in lk.operation  # where -> ?:
    assert src.name.startswith("ss_bias_swish_") and src.name.isidentifier()


def test_cuda_source_of_a_reduction(K):
    src = expr_kernel(K["rms"]).cuda_source(["f32"], ["f32"])
    assert src.kind == "reduction" and src.reduce_expr == "a + b" and src.identity == "0"
    assert src.reduce_type == "double" and src.inputs == (0,)
    assert src.in_params == "float32 a0, float64 p0, float64 cnt" and src.out_params == "float32 y0"
    assert src.map_expr.startswith(src.name + "_map((float)a0")
    assert "(a / cnt)" in src.post_map_expr and src.post_map_expr.startswith("y0 = (float)(")
    assert "sqrt(" in src.preamble and src.post is None
    sm = expr_kernel(K["scaled_mean"]).cuda_source(["f32", "f32"], ["f32"])
    assert sm.inputs == (0,) and sm.post is not None  # the post expression reads s: a second, in-place pass
    post_in, post_out, post_op = sm.post
    assert post_in == "float32 a1, float64 cnt" and post_out == "float32 y0" and "const float _s = (float)y0;" in post_op
    mx = expr_kernel(compile_kernels("kernel m(x : T[n, k]) -> y : T[n] { y = max(x, axis = 1) }")["m"])
    ms = mx.cuda_source(["f64"], ["f64"])
    assert ms.identity == "-ss_inf()" and "isnan(a)" in ms.reduce_expr and ms.reduce_type == "double"


def _cxx(src: str, tmp_path):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to check the CUDA twin's device code on the CPU")
    path = tmp_path / "k.cpp"
    path.write_text(src)
    lib = tmp_path / "k.so"
    subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", str(path), "-o", str(lib)], check=True,
                   capture_output=True)
    import ctypes

    return ctypes.CDLL(str(lib))


_HOST = """#include <cmath>
#include <cstring>
#include <cstdint>
using namespace std;
#define __device__
#define __forceinline__ inline
static double __longlong_as_double(long long v) { double d; memcpy(&d, &v, 8); return d; }
"""


@pytest.mark.parametrize("name", ["swish", "bias_swish", "leaky", "two"])
def test_cuda_device_code_compiles_and_matches_the_numpy_twin(K, name, tmp_path):
    """The text SymPy's C printer wrote for the ElementwiseKernel, compiled by the host C++
    compiler with CuPy's per-element names bound to array elements, on f64 data."""
    rec = K[name]
    nin = len(rec.inputs)
    src = expr_kernel(rec).cuda_source(["f64"] * nin, ["f64"] * len(rec.outputs))
    nattr = len(rec.attrs)
    params = [f"const double* a{i}_" for i in range(nin)] + [f"double p{j}" for j in range(nattr)]
    params += ["double cnt"] + [f"double* y{k}_" for k in range(len(rec.outputs))]
    loads = "".join(f"const double a{i} = a{i}_[i];" for i in range(nin))
    stores = "".join(f"double& y{k} = y{k}_[i];" for k in range(len(rec.outputs)))
    code = _HOST + src.preamble + f'extern "C" void run(int n, {", ".join(params)}) {{\n' \
        f"for (int i = 0; i < n; ++i) {{ {loads} {stores}\n{src.operation}\n}} }}\n"
    lib = _cxx(code, tmp_path)
    import ctypes

    rng = np.random.default_rng(7)
    ins = [rng.normal(size=24) * 4 for _ in range(nin)]
    attrs = {k: 0.3 for k in rec.attrs}
    want = run(rec, ins, attrs)
    outs = [np.zeros(24) for _ in rec.outputs]
    ptr = ctypes.POINTER(ctypes.c_double)
    args = [ctypes.c_int(24)] + [a.ctypes.data_as(ptr) for a in ins] + [ctypes.c_double(0.3)] * nattr
    args += [ctypes.c_double(1.0)] + [o.ctypes.data_as(ptr) for o in outs]
    lib.run(*args)
    for o, w in zip(outs, want):
        np.testing.assert_allclose(o, w, rtol=1e-14, atol=1e-300)


def test_cuda_reduction_device_functions_compile(K, tmp_path):
    src = expr_kernel(K["rms"]).cuda_source(["f64"], ["f64"])
    code = _HOST + src.preamble + f"""
extern "C" double run(const double* x, int n, double eps) {{
    double a = 0; for (int i = 0; i < n; ++i) a += {src.map_expr.replace("(double)a0", "(double)x[i]").replace("(double)p0", "(double)eps").replace("(double)cnt", "(double)n")};
    const double cnt = n; const double p0 = eps; double y0;
    {src.post_map_expr};
    return y0;
}}
"""
    lib = _cxx(code, tmp_path)
    import ctypes

    lib.run.restype = ctypes.c_double
    x = np.random.default_rng(2).normal(size=9)
    got = lib.run(x.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), 9, ctypes.c_double(0.5))
    assert math.isclose(got, float(np.sqrt((x * x).mean() + 0.5)), rel_tol=1e-14)
