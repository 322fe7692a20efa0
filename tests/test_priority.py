"""interp/priority.py: the unit DAG from a plan's instructions, the roofline cost and the slack
levels, against an independent oracle (all paths of a small DAG enumerated)."""

import itertools
import random

import pytest

from streamsched.interp.ir import Instr, Task
from streamsched.interp.priority import LAUNCH_US, slack_levels, task_cost_us, task_flops, unit_dag


def L(task, stream):
    return Instr("launch", stream, task=task)


def R(ev, stream):
    return Instr("record", stream, event=ev)


def W(ev, stream):
    return Instr("wait", stream, event=ev)


def test_unit_dag_is_stream_order_plus_record_to_wait():
    # linear.backward's fork: t0 (dy) on c3, then dW on c1, dB on c2, dX on c3; dX -> t4 on c3
    instrs = [L(0, "c3"), R(0, "c3"), W(0, "c1"), L(1, "c1"), W(0, "c2"), L(2, "c2"), L(3, "c3"),
              W(9, "c3"),  # a wait on an event recorded before the unit: no edge
              L(4, "c3"), R(1, "c1"), W(1, "c3"), L(5, "c3")]
    order, preds = unit_dag(instrs)
    assert order == [0, 1, 2, 3, 4, 5]
    assert preds == {0: set(), 1: {0}, 2: {0}, 3: {0}, 4: {3}, 5: {4, 1}}


def test_a_wait_binds_to_the_latest_record_before_it():
    instrs = [L(0, "a"), R(0, "a"), L(1, "a"), R(0, "a"), W(0, "b"), L(2, "b")]
    assert unit_dag(instrs)[1][2] == {1}


def _oracle_slack(order, preds, cost):
    """Slack by enumerating every source-to-sink path (exponential; small DAGs only)."""
    succ = {t: [s for s in order if t in preds[s]] for t in order}
    paths = []

    def walk(t, acc):
        acc = acc + [t]
        if not succ[t]:
            paths.append(acc)
        for s in succ[t]:
            walk(s, acc)

    for t in order:
        if not preds[t]:
            walk(t, [])
    length = {tuple(p): sum(cost[x] for x in p) for p in paths}
    cp = max(length.values())
    return {t: cp - max(v for p, v in length.items() if t in p) for t in order}, cp


@pytest.mark.parametrize("seed", range(30))
def test_slack_levels_match_an_all_paths_oracle(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    order = list(range(n))
    preds = {t: {p for p in range(t) if rng.random() < 0.35} for t in order}
    cost = {t: rng.choice([1.0, 3.0, 10.0, 80.0]) for t in order}
    slack, cp = _oracle_slack(order, preds, cost)
    bands = (0.02, 0.10, 0.25)
    got = slack_levels(order, preds, cost, 4, bands)
    for t in order:
        frac = slack[t] / cp
        want = next((i for i, b in enumerate(bands) if frac <= b + 1e-9), 3)
        assert got[t] == want, (t, slack[t], cp)
    assert min(got.values()) == 0  # some path is critical
    assert slack_levels(order, preds, cost, 2, bands) == {t: min(v, 1) for t, v in got.items()}


def test_the_weight_gradient_is_off_the_critical_path():
    # dy -> [dW (80 us) ; dX (80 us) -> dReLU (5 us) -> dW' (60 us)] -> sgd
    order = [0, 1, 2, 3, 4, 5]
    preds = {0: set(), 1: {0}, 2: {0}, 3: {2}, 4: {3}, 5: {1, 4}}
    cost = {0: 5.0, 1: 80.0, 2: 80.0, 3: 5.0, 4: 60.0, 5: 10.0}
    lv = slack_levels(order, preds, cost, 4)
    assert [lv[t] for t in (0, 2, 3, 4, 5)] == [0] * 5
    assert lv[1] == 3  # slack 65 of 160 us: 41 %


def test_an_order_that_is_not_topological_is_refused():
    with pytest.raises(ValueError, match="not before it"):
        slack_levels([1, 0], {0: set(), 1: {0}}, {0: 1.0, 1: 1.0}, 4)


def test_roofline_cost_of_a_gemm_and_of_an_elementwise_kernel():
    shapes = {"x": (2048, 1024), "w": (1024, 1024), "y": (2048, 1024), "m": (2048, 1024)}
    nbytes = {k: 4 * v[0] * v[1] for k, v in shapes.items()}
    mm = Task(0, "matmul", "c1", args=("x", "w"), outs=("y",))
    assert task_flops(mm, shapes) == 2 * 2048 * 1024 * 1024
    mt = Task(1, "matmul", "c1", args=("x", "y"), outs=("w",), attrs=(("ta", True),))
    assert task_flops(mt, shapes) == 2 * 1024 * 1024 * 2048  # k = x's rows when transposed
    rg = Task(2, "relu_grad", "c3", args=("y", "m"), outs=("x",))
    assert task_flops(rg, shapes) == 0
    assert task_cost_us(rg, shapes, nbytes) == pytest.approx(LAUNCH_US + 3 * 8 * 2 ** 20 / 2.5e6)
    assert task_cost_us(mm, shapes, nbytes) == pytest.approx(LAUNCH_US + 2 * 2048 * 1024 * 1024 / 40e6)
    same = Task(3, "add", "c3", args=("x", "x"), outs=("x",))  # a buffer counts once
    assert task_cost_us(same, shapes, nbytes) == pytest.approx(LAUNCH_US + 8 * 2 ** 20 / 2.5e6)


@pytest.mark.parametrize("env, value, why", [("STREAMSCHED_PRIORITIES", "on", "`on` is not off or slack"),
                                             ("STREAMSCHED_PRIORITIES", "critical", "`critical` is not off or slack"),
                                             ("STREAMSCHED_SKINNY_GEMM", "yes", "`yes` is not 1, all or 0"),
                                             ("STREAMSCHED_SKINNY_GEMM", "2", "`2` is not 1, all or 0")])
def test_a_mistyped_setting_is_refused_before_a_run(monkeypatch, env, value, why):
    import os

    from streamsched.diagnostics import StreamschedError
    from streamsched.interp.train import TrainOptions, train
    from streamsched.pipeline import compile_file

    monkeypatch.setenv(env, value)
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    c = compile_file(os.path.join(examples, "mlp_digits.sched"))
    with pytest.raises(StreamschedError) as err:
        train(c, TrainOptions(backend="cpu", progress=False, epochs=1), base_dir=examples, echo=lambda s: None)
    (d,) = err.value.diagnostics
    assert d.code == "X004" and d.message == f"${env}: {why}"


@pytest.mark.parametrize("value, want", [(None, "off"), ("", "off"), (" Slack ", "slack"), ("OFF", "off")])
def test_the_accepted_spellings(monkeypatch, value, want):
    from streamsched.interp import priority

    if value is None:
        monkeypatch.delenv("STREAMSCHED_PRIORITIES", raising=False)
    else:
        monkeypatch.setenv("STREAMSCHED_PRIORITIES", value)
    assert priority.mode() == want


def test_attention_flops_count_each_context_product_once():
    # b = 4 sequences of t = 64, d = 128 (any heads): one [t, t] x [t, dh] product over all
    # sequences and heads is 2 * (b t) * t * d flops
    shapes = {"q": (256, 128), "k": (256, 128), "v": (256, 128), "y": (256, 128), "p": (4, 8, 64, 64)}
    one = 2 * 256 * 128 * 64
    ctx = (("heads", 8), ("context", 64))
    assert task_flops(Task(0, "attn_scores", "c1", args=("q", "k"), outs=("p",), attrs=ctx), shapes) == one
    assert task_flops(Task(1, "attn_apply", "c1", args=("p", "v"), outs=("y",)), shapes) == one
    assert task_flops(Task(2, "attn_fused", "c1", args=("q", "k", "v"), outs=("y", "p"), attrs=ctx), shapes) == 2 * one
    grad = Task(3, "attn_fused_grad", "c1", args=("y", "q", "k", "v", "p"), outs=("q", "k", "v"), attrs=ctx)
    assert task_flops(grad, shapes) == 5 * one
