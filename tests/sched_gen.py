"""A hypothesis generator of `.sched` programs as users write them, for the soundness properties
of issue 11 (tests/test_soundness_properties.py).

A program has a few streams (the seed's canonical names, so the stdlib places itself), a small
MLP over the stdlib ops (linear, relu, tanh, gelu, sigmoid, add) and user ops, graphs (a slotted
or plain load, zero_grad, pass, optimize), a step in one of several valid launch orders, and a
train block on the digits with a tiny batch.  User ops fork kernels over streams (`on S`), write
`into` an input or an earlier result and carry `after` clauses; some redefine stdlib ops (an
in-place relu, a linear backward whose dX overwrites X, as the seed does).

Every `into` is tagged when it is generated: *legal* when the buffer it overwrites has no reader
after the statement in program order (the statement is its last reader), *illegal* when some
later reader still needs it (a residual add reading a relu's input, gelu's backward reading its
input, a backward reading an activation a later dX overwrote).  The tags are for counting and
for the report; the properties never trust them (their oracle compares results).

Under `explicit` the generator writes the `after` clauses a careful user writes (every model
line after the values it reads, every launch after the launches it depends on, in this step or
the previous one); with some probability it leaves one out, and the checker then rejects the
file: those programs count as not clean.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hypothesis import strategies as st

ACTS = ("relu", "tanh", "gelu", "sigmoid")
"""Stdlib activations; relu, tanh and sigmoid differentiate from their output, gelu from its
input (src/streamsched/stdlib/ops.sched)."""
FROM_OUTPUT = {"relu", "tanh", "sigmoid", "stanh"}
"""Activations whose backward reads their output, not their input (stanh: the user op below)."""


@dataclass
class GenProgram:
    """One generated program: its text and what the generator put in it."""

    text: str
    policy: str
    capture: str
    slotted: bool
    intos: list[tuple[str, bool]] = field(default_factory=list)
    """(description, legal) for every `into` written in the file."""
    explicit_complete: bool = True
    """False when an `after` a careful user writes was left out on purpose (explicit only)."""
    batch: int = 32
    steps_per_epoch: int = 5

    @property
    def has_into(self) -> bool:
        return bool(self.intos)

    @property
    def all_into_legal(self) -> bool:
        return all(ok for _, ok in self.intos)


def strip_into(text: str) -> str:
    """The program with every `into NAME` clause removed (nothing else changes, so every line
    keeps its number and the `after` clauses stay)."""
    return re.sub(r"[ \t]into[ \t]+[A-Za-z_][A-Za-z0-9_]*", "", text)


@st.composite
def programs(draw, policy: str | None = None, capture: str | None = None) -> GenProgram:
    """A whole `.sched` file (see the module docstring)."""
    policy = policy or draw(st.sampled_from(["auto", "explicit"]))
    capture = capture or draw(st.sampled_from(["none", "graphs", "step"]))
    explicit = policy == "explicit"
    # Leave out one `after` a careful user writes, now and then (explicit only).
    forget = explicit and draw(st.integers(0, 4)) == 0
    forgettable: list[str] = []

    computes = ["comp1"] + [c for c in ("comp2", "comp3") if draw(st.booleans())]
    streams = ["trans"] + computes + ["update"]
    pick = st.sampled_from(computes)
    intos: list[tuple[str, bool]] = []
    ops: list[str] = []

    # ---- the model's shape, drawn first: which values have readers later decides legality --
    depth = draw(st.integers(1, 2))
    acts: list[str] = []
    for _ in range(depth):
        acts.append(draw(st.sampled_from(ACTS + ("stanh",))))
    residual = depth == 2 and draw(st.booleans())
    # the residual adds the second activation and a pre-activation (h1) or an activation (a1)
    res_src = draw(st.sampled_from(["h1", "a1"])) if residual else ""
    res_op = draw(st.sampled_from(["add", "mix2"])) if residual else ""

    def h_read_later(i: int) -> bool:
        """Whether the pre-activation h_i has a reader after act_i (in the forward: the residual;
        gelu's backward reads its input too, which the callers check)."""
        return residual and res_src == f"h{i}"

    # ---- user ops ----------------------------------------------------------------------------
    used_acts = set(acts)
    for a in sorted(used_acts & {"relu", "tanh", "sigmoid", "gelu"}):
        if draw(st.integers(0, 3)) == 0:  # an in-place activation, as the seed writes dX over X
            s = draw(pick)
            ops.append(f"op {a}(x) -> y on {s} {{\n    y = {a}(x) into x\n}}\n")
            # into x overwrites the layer's pre-activation h: legal when nothing reads h later
            # (gelu's own backward reads it)
            legal = a != "gelu" and not any(h_read_later(i + 1) for i, b in enumerate(acts) if b == a)
            intos.append((f"{a}(x) into x", legal))

    if "stanh" in used_acts:
        s_fwd, s_fork = draw(pick), draw(pick)
        into_u = draw(st.booleans())
        into_du = draw(st.booleans())
        aft = " after u" if explicit and s_fwd != s_fork else ""
        if aft:
            forgettable.append("stanh.y after u")
        ops.append(
            f"op stanh(x) -> y on {s_fwd} {{\n"
            f"    u = x * 0.5 on {s_fork}\n"
            f"    y = tanh(u){' into u' if into_u else ''}{aft}\n"
            f"}}\n"
        )
        if into_u:
            intos.append(("stanh: y = tanh(u) into u", True))  # u's last reader is this statement
        b_fwd, b_fork = draw(pick), draw(pick)
        aft = " after du" if explicit and b_fwd != b_fork else ""
        ops.append(
            f"op stanh.backward(dy, y) -> dx on {b_fwd} {{\n"
            f"    du = tanh_grad(dy, y)\n"
            f"    dx = du * 0.5 on {b_fork}{' into du' if into_du else ''}{aft}\n"
            f"}}\n"
        )
        if into_du:
            intos.append(("stanh.backward: dx = du * 0.5 into du", True))

    if res_op == "mix2":
        s_fwd, s_fork = draw(pick), draw(pick)
        into_t = draw(st.booleans())
        aft = " after t" if explicit and s_fwd != s_fork else ""
        ops.append(
            f"op mix2(a, b) -> y on {s_fwd} {{\n"
            f"    t = a + b on {s_fork}\n"
            f"    y = relu(t){' into t' if into_t else ''}{aft}\n"
            f"}}\n"
        )
        if into_t:
            intos.append(("mix2: y = relu(t) into t", True))
        b_fwd, b_fork = draw(pick), draw(pick)
        aft = " after g" if explicit and b_fwd != b_fork else ""
        ops.append(
            f"op mix2.backward(dy, y) -> (da, db) on {b_fwd} {{\n"
            f"    g = relu_grad(dy, y)\n"
            f"    da = copy(g)\n"
            f"    db = copy(g) on {b_fork}{aft}\n"
            f"}}\n"
        )

    if draw(st.booleans()):  # the linear backward forked over streams, as the seed writes it
        s_dw, s_db, s_dx = draw(pick), draw(pick), draw(pick)
        into_x = draw(st.integers(0, 2)) == 0
        clauses = ""
        if into_x:
            clauses += " into x"
            # dX of layer i overwrites its input x: a_{i-1}, or s after a residual.  The input is
            # still needed when a backward that runs later reads it: the activation's backward
            # when it differentiates from its output, mix2's backward (it reads its output s).
            # (The residual's own read of a_i is in the forward, long before.)
            inputs = [a for a in acts[:-1]] + ([] if residual else [acts[-1]])
            legal = not any(a in FROM_OUTPUT for a in inputs) and res_op != "mix2"
            intos.append(("linear.backward: dx into x", legal))
            if explicit or draw(st.booleans()):
                clauses += " after dw"
                if explicit:
                    forgettable.append("linear.backward.dx after dw")
        ops.append(
            "op linear.backward(dy, x, w) -> (dx, dw, db) on comp1 {\n"
            f"    dw = matmul(x^T, dy)   on {s_dw}\n"
            f"    db = sum(dy, axis = 0) on {s_db}\n"
            f"    dx = matmul(dy, w^T)   on {s_dx}{clauses}\n"
            "}\n"
        )

    # ---- the model ---------------------------------------------------------------------------
    hidden = 16
    lines = []

    def after(*names: str) -> str:
        if not explicit:
            return ""
        return " after " + ", ".join(names)

    prev = "x"
    for i, a in enumerate(acts, start=1):
        lines.append(f"    h{i} = linear({prev}, hidden){after(prev) if prev != 'x' else ''}")
        model_into = ""
        if draw(st.integers(0, 9)) == 0:  # `into` on a model line, as users try to write it
            model_into = f" into h{i}"
            legal = a in FROM_OUTPUT and not h_read_later(i) and a != "gelu"
            intos.append((f"model line a{i} = {a}(h{i}) into h{i}", legal))
        lines.append(f"    a{i} = {a}(h{i}){model_into}{after(f'h{i}')}")
        prev = f"a{i}"
    if residual:
        lines.append(f"    s = {res_op}(a2, {res_src}){after('a2', res_src)}")
        prev = "s"
    lines.append(f"    logits = linear({prev}, 10){after(prev)}")
    lines.append("    loss   = softmax_cross_entropy(logits, y)" + after("logits"))

    # ---- graphs and the step -----------------------------------------------------------------
    slotted = draw(st.booleans())
    load = "graph load[a, b] on trans { copy batch -> x, y }" if slotted else \
        "graph load on trans { copy batch -> x, y }"
    momentum = draw(st.sampled_from(["0.9", "0.0", "0.5"]))
    graphs = [
        load,
        "graph zero_grad on update { clear grad(net) }",
        "graph pass on comp1 { forward net; backward net }",
        f"graph optimize on update {{ sgd(net, lr, momentum = {momentum}) }}",
    ]
    # Valid launch orders: zero_grad before pass, optimize after pass, the upload before
    # optimize; the prefetch (slotted) anywhere; a plain load before pass.
    order = draw(st.sampled_from([
        ("upload", "zero_grad", "pass", "load", "optimize"),
        ("upload", "zero_grad", "pass", "optimize", "load"),
        ("zero_grad", "upload", "load", "pass", "optimize"),
        ("load", "zero_grad", "pass", "upload", "optimize"),
        ("zero_grad", "load", "pass", "optimize", "upload"),
    ]))
    if not slotted and order.index("load") > order.index("pass"):
        order = tuple(x for x in order if x != "load")
        order = order[: order.index("pass")] + ("load",) + order[order.index("pass"):]
    if order.index("upload") > order.index("optimize"):
        order = tuple(x for x in order if x != "upload")
        order = order[: order.index("optimize")] + ("upload",) + order[order.index("optimize"):]
    step = []
    seen: set[str] = set()
    for name in order:
        deps: list[str] = []
        if name == "upload":
            deps = ["prev.optimize"]
            text = "upload lr on trans"
        elif name == "zero_grad":
            deps = ["prev.optimize"]
            text = "zero_grad"
        elif name == "pass":
            deps = ["zero_grad", "prev.optimize"] + ([] if slotted else ["load"])
            text = "pass(load[slot])" if slotted else "pass"
        elif name == "load":
            deps = ["prev.pass"]
            text = "load[next]" if slotted else "load"
        else:
            deps = ["pass", "upload.lr"]
            text = "optimize"
        deps = [d for d in deps if d.startswith("prev.") or d in seen or d == "upload.lr" and "upload" in seen]
        if explicit and deps:
            text += " after " + ", ".join(deps)
            forgettable.extend(f"{name} after {d}" for d in deps)
        step.append(f"    {text}")
        seen.add(name)

    explicit_complete = True
    if forget and forgettable:
        # drop one `after` a careful user writes: in an op body, or in the step
        gone = draw(st.sampled_from(forgettable))
        explicit_complete = False
        if gone == "stanh.y after u":
            ops = [o.replace(" after u\n", "\n", 1) for o in ops]
        elif gone == "linear.backward.dx after dw":
            ops = [o.replace(" after dw\n", "\n", 1) for o in ops]
        else:
            name, _, dep = gone.partition(" after ")
            heads = {"upload lr on trans": "upload", "pass(load[slot])": "pass", "load[next]": "load"}
            new = []
            for line in step:
                head, _, rest = line.strip().partition(" after ")
                if heads.get(head, head) == name and rest:
                    deps = [d for d in rest.split(", ") if d != dep]
                    line = "    " + head + (" after " + ", ".join(deps) if deps else "")
                new.append(line)
            step = new

    batch = 32
    lr = draw(st.sampled_from(["0.05", "cosine(0.05, warmup = 2)", "step(0.05, every = 3, gamma = 0.5)"]))
    text = "\n".join([
        f"# generated: policy {policy}, capture {capture}",
        "streams {",
        *[f"    {s} : {'copy' if s == 'trans' else 'update' if s == 'update' else 'compute'}" for s in streams],
        "}",
        "",
        *ops,
        f"model net(batch = {batch}, hidden = {hidden}) {{",
        "    input x : f32[batch, 64]",
        "    input y : i32[batch]",
        *lines,
        "}",
        "",
        *graphs,
        "",
        "step train(slot) {" if slotted else "step train {",
        *step,
        "}",
        "",
        "train {",
        "    model    = net",
        "    data     = digits(test = 0.9, seed = 0)",
        "    epochs   = 2",
        f"    lr       = {lr}",
        f"    capture  = {capture}",
        f"    barriers = {policy}",
        "}",
        "",
    ])
    return GenProgram(text, policy, capture, slotted, intos, explicit_complete, batch, 179 // batch)
