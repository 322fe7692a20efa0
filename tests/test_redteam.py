"""What the red-team corpus (tests/test_corpus.py) found the checker too strict about, or reporting
under the wrong code, each pinned by a focused test:

1. A host `synchronize` between launches did not order the launches after it, though the host
   issues them only once every earlier piece of work is done (cudaDeviceSynchronize): a false
   R001 on `pass; synchronize; optimize` under explicit.
2. An `upload` in the body of a graph without slots, in a program with double-buffered inputs,
   made that graph need a slot (S017) that it cannot be given (`G[slot]` on a graph with no
   slots is S009): the program could not be written at all, and the help offered that form.
3. Under capture = step, a pinned staging buffer written twice in one step (an unslotted load, or
   an upload, launched twice) was reported as an R002 cycle through an `after` nobody wrote; the
   host would have to wait inside the step's graph, which is C003.
4. An upload repeated in a step before anything read the first one was S023 ("overwritten before
   it is read"), though it only copies the same value again, like a second `clear`.
"""

from __future__ import annotations

import os

from streamsched.interp.validate import analyse_plan
from streamsched.pipeline import check_file, compile_file

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")

STREAMS = "streams {\n    trans  : copy\n    comp1  : compute\n    comp2  : compute\n    comp3  : compute\n" \
          "    update : update\n}\n"
MODEL = """model mlp(batch = 8, hidden = 16) {
    input x : f32[batch, 64]
    input y : i32[batch]
    h1     = linear(x, hidden)
    a1     = relu(h1) after h1
    logits = linear(a1, 10) after a1
    loss   = softmax_cross_entropy(logits, y)
}
"""
GRAPHS = """graph load[a, b] on trans  { copy batch -> x, y }
graph zero_grad  on update { clear grad(mlp) }
graph pass       on comp1  { forward mlp; backward mlp }
graph optimize   on update { sgd(mlp, lr, momentum = 0.9) }
"""
TRAIN = "train { model = mlp; data = digits(test = 0.2, seed = 0); epochs = 1; lr = 0.05; capture = graphs }\n"


def write(tmp_path, text: str, name: str = "p.sched") -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def errors(path: str, **kw) -> list[tuple[str, int]]:
    return sorted({(d.code, d.span.line if d.span else 0) for d in check_file(path, **kw) if d.severity == "error"})


def line_of(text: str, needle: str) -> int:
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


# -- 1. synchronize orders what the host issues after it -----------------------------------------

SYNC_STEP = """step train(slot) {
    upload lr on trans after prev.optimize
    zero_grad after prev.optimize
    pass(load[slot]) after zero_grad, prev.optimize
    load[next] after prev.pass
    synchronize
    optimize after upload.lr
}
"""


def _hb_before(plan, first: int, second: int) -> bool:
    """Whether task `first` happens before task `second` in `plan` (no race between a write of a
    fresh buffer by `first` and a read of it by `second` means ordered): asked of the checker's
    own analysis on a copy of the plan whose two tasks conflict on purpose."""
    from dataclasses import replace

    s = plan.schedule
    tasks = list(s.tasks)
    tasks[first] = replace(tasks[first], outs=tasks[first].outs + ("probe!",))
    tasks[second] = replace(tasks[second], args=tasks[second].args + ("probe!",))
    probe = replace(plan, schedule=replace(s, tasks=tuple(tasks)), analysis=None)
    return not any(r.buffer == "probe!" for r in analyse_plan(probe).races)


def test_synchronize_orders_the_launches_issued_after_it(tmp_path):
    text = "barriers explicit\n" + STREAMS + MODEL + GRAPHS + SYNC_STEP + TRAIN
    p = write(tmp_path, text)
    assert errors(p) == []
    c = compile_file(p)
    tasks = c.schedule.tasks
    # every dW of the step's pass happens before every optimizer task of the same step
    dws = [t.id for t in tasks if t.step == 0 and t.label.endswith(".dw")]
    opts = [t.id for t in tasks if t.step == 0 and (t.kernel == "sgd_step" or t.attr("base") == "sgd_step")]
    assert dws and opts and all(_hb_before(c.plan, a, b) for a in dws for b in opts)
    # two launches issued before the synchronize are not ordered by it: zero_grad against the pass
    race = text.replace("pass(load[slot]) after zero_grad, prev.optimize", "pass(load[slot]) after prev.optimize")
    assert {code for code, _ in errors(write(tmp_path, race, "r.sched"))} == {"R001"}


def test_synchronize_under_step_capture_orders_nothing_and_is_c003(tmp_path):
    text = "barriers explicit\n" + STREAMS + MODEL + GRAPHS + SYNC_STEP + TRAIN.replace("graphs", "step")
    assert ("C003", line_of(text, "synchronize")) in errors(write(tmp_path, text))


# -- 2. an upload in a graph without slots keeps the graph slot-free ---------------------------------

UPLOAD_GRAPHS = GRAPHS.replace("graph optimize   on update { sgd(mlp, lr, momentum = 0.9) }\n", """graph optimize   on update {
    upload lr on trans
    sgd(mlp, lr, momentum = 0.9) after upload.lr
}
""")
UPLOAD_STEP = "step train(slot) {\n    zero_grad\n    pass(load[slot])\n    load[next]\n    optimize\n}\n"


def test_upload_in_a_graph_without_slots_needs_no_slot(tmp_path):
    for capture in ("none", "graphs", "step"):
        p = write(tmp_path, STREAMS + MODEL.replace(" after h1", "").replace(" after a1", "") + UPLOAD_GRAPHS
                  + UPLOAD_STEP + TRAIN.replace("graphs", capture), f"u_{capture}.sched")
        assert errors(p) == [], capture
        c = compile_file(p)
        staging = {b.name for b in c.schedule.buffers if b.name.startswith("lr@host")}
        assert staging == {"lr@host"}, staging  # one pinned buffer: the graph has one instance


def test_s017_help_offers_only_forms_valid_for_the_graph(tmp_path):
    step = UPLOAD_STEP.replace("pass(load[slot])", "pass")
    p = write(tmp_path, STREAMS + MODEL + GRAPHS + step + TRAIN)
    ds = [d for d in check_file(p) if d.code == "S017"]
    assert len(ds) == 1 and "`pass(load[slot])`" in ds[0].help and "pass[slot]" not in ds[0].help
    slotted = (STREAMS + MODEL + GRAPHS.replace("graph pass       on comp1", "graph pass[a, b]  on comp1")
               + step + TRAIN)
    ds = [d for d in check_file(write(tmp_path, slotted, "s.sched")) if d.code == "S017"]
    assert len(ds) == 1 and "`pass[slot]`" in ds[0].help


# -- 3. a staging buffer written twice in a captured step is C003, not a cycle ----------------------

TWICE = """graph load     on trans  { copy batch -> x, y }
graph pass     on comp1  { forward mlp; backward mlp }
graph probe    on comp1  { forward mlp }
graph optimize on update { sgd(mlp, lr) }
step train {
    upload lr on trans
    load
    pass
    optimize
    load
    probe
}
"""


def test_staging_rewritten_inside_a_captured_step_is_c003(tmp_path):
    text = STREAMS + MODEL.replace(" after h1", "").replace(" after a1", "") + TWICE
    p = write(tmp_path, text + TRAIN.replace("graphs", "step"))
    second = [i for i, ln in enumerate(text.splitlines(), 1) if ln.strip() == "load"][1]
    ds = [d for d in check_file(p) if d.severity == "error"]
    assert [(d.code, d.span.line) for d in ds] == [("C003", second)], [d.message for d in ds]
    assert "`x@host`, `y@host`" in ds[0].message and "capture = graphs" in ds[0].help
    # the host waits between graph launches: the same step is fine under capture = graphs
    assert errors(write(tmp_path, text + TRAIN, "g.sched")) == []


def test_upload_twice_inside_a_captured_step_is_c003():
    p = os.path.join(CORPUS, "host_two_uploads_of_lr_capture_step.sched")
    ds = [d for d in check_file(p) if d.severity == "error"]
    assert "R002" not in {d.code for d in ds}
    c3 = [d for d in ds if d.code == "C003"]
    assert len(c3) == 1 and "`lr@host`" in c3[0].message and "upload it once per step" in c3[0].help


# -- 4. a repeated upload is harmless -------------------------------------------------------------

def test_repeated_upload_is_not_s023_but_a_lost_value_still_is(tmp_path):
    step = """step train(slot) {
    upload lr on trans
    zero_grad
    pass(load[slot])
    load[next]
    upload lr on trans
    optimize
}
"""
    plain = MODEL.replace(" after h1", "").replace(" after a1", "")
    assert errors(write(tmp_path, STREAMS + plain + GRAPHS + step + TRAIN)) == []
    # what S023 is for is still found: zero_grad between the backward and the optimizer
    lost = step.replace("    zero_grad\n", "").replace("    upload lr on trans\n    optimize", "    zero_grad\n    optimize")
    assert "S023" in {c for c, _ in errors(write(tmp_path, STREAMS + plain + GRAPHS + lost + TRAIN, "l.sched"))}
