"""Op expansion: one op call's body lowered, statement by statement, into task templates (one
kernel launch each), each launch type-checked by its kernel's type rule and its output buffers
created; the context of the call travels in one frozen `Lowering` record.

Source: LANGUAGE.md ("Ops", "into", "after"), docs/kernels.md (the kernels and their type rules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamsched.diagnostics import Label
from streamsched.dsl import ast as A
from streamsched.dsl.names import Streams, expr_names
from streamsched.dsl.program import SLOT, TaskTemplate
from streamsched.dsl.scope import Buffers, Scope, Sink, _Abort
from streamsched.dsl.types import const
from streamsched.interp.ir import Site, Span, evolve
from streamsched.stdlib.kernel_record import KernelTypeError

_KERNELS_HELP = ("kernels are the stdlib primitives listed in docs/kernels.md, the file's `kernel` forms and those "
                 "of `--kernels` modules")


@dataclass(frozen=True)
class Lowering:
    """The context every launch of one op call is lowered in.

    stream: the stream of the statement at hand (its `on`, a placement, else rep); rep: the op's
    representative stream (TaskTemplate.rep_stream); op_id: the call's index in its graph
    (TaskTemplate.op); label: `op@value`, the prefix of its tasks' labels and temporaries; out:
    the template list the launches are appended to, in issue order; op: the
    op whose body is lowered (None for a launch no body makes, a gradient sum); env: the body's
    names -> buffers (parameters, outputs, the results so far: it grows statement by statement);
    attrs: the call's attribute and dimension values, the body's constants; call_span: the user's
    line that called the op; stdlib: the op's lines are not the user's (a stdlib or derived op),
    so diagnostics and tasks point at call_span; nested: id(nested call AST) -> its temporary
    buffer (a derived backward reads them)."""

    stream: str
    rep: str
    op_id: int
    label: str
    out: list[TaskTemplate]
    op: A.OpDef | None = None
    env: dict[str, str] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    call_span: Span | None = None
    stdlib: bool = False
    nested: dict[int, str] = field(default_factory=dict)


def as_call(sink: Sink, e: A.Expr) -> A.Call:
    """An operator expression of an op body as the kernel call it stands for: `a + b` is
    `add(a, b)`, `2 * x` and `x / 2` are `scale(x, alpha = ...)`, `-x` is `scale(x, alpha = -1)`;
    fails S015 for what no kernel computes (division by a buffer, a misplaced `^T`)."""
    if isinstance(e, A.BinOp):
        if e.op == "*" and isinstance(e.left, A.Num):
            return A.Call(A.Name("scale", e.span), (e.right,), (A.KwArg(A.Name("alpha"), e.left),), e.span)
        if e.op in "*/" and isinstance(e.right, A.Num):
            if e.op == "/" and e.right.value == 0:
                sink.fail("S015", "division by zero", e.span, help="divide by a number other than 0")
            v = e.right.value if e.op == "*" else 1.0 / e.right.value
            return A.Call(A.Name("scale", e.span), (e.left,), (A.KwArg(A.Name("alpha"), A.Num(v)),), e.span)
        if e.op == "/":
            sink.fail("S015", "division by a buffer is not a kernel", e.span)
        name = {"+": "add", "-": "sub", "*": "mul"}[e.op]
        return A.Call(A.Name(name, e.span), (e.left, e.right), (), e.span)
    if isinstance(e, A.Neg):
        return A.Call(A.Name("scale", e.span), (e.operand,), (A.KwArg(A.Name("alpha"), A.Num(-1.0)),), e.span)
    if isinstance(e, A.Transpose):
        sink.fail("S015", "`^T` transposes a matmul argument only", e.span)
    sink.fail("S015", "a kernel call is expected here", e.span)


def _feeding(body, need: set[str]) -> list[A.KernelStmt]:
    """The statements of `body` that feed one of the results `need`, in body order."""
    wanted = set(need)
    keep = []
    for st in reversed(body):
        if any(t.id in wanted for t in st.targets):
            keep.append(st)
            wanted |= expr_names(st.expr)
    keep_ids = {id(s) for s in keep}
    return [s for s in body if id(s) in keep_ids]


class Lowerer:
    """Expands op calls into task templates over the run's buffer table; its `_tmp` counter
    names the temporaries of nested calls uniquely across the run."""

    def __init__(self, scope: Scope, buffers: Buffers, streams: Streams):
        self.scope, self.buffers, self.streams = scope, buffers, streams
        self.fail = scope.sink.fail
        self._tmp = 0

    def expand_op(self, op: A.OpDef, bind: dict[str, str], attrs: dict[str, Any], out: list[TaskTemplate], *,
                  op_id: int, prefix: str, label: str, call_span: Span | None, need: set[str] | None = None,
                  on: str | None = None) -> Lowering:
        """Append the templates of one call of `op` to `out`; return the call's final Lowering
        (its env maps every body name to its buffer, its nested the temporaries of nested calls).

        bind: op param/out name -> buffer name (outputs not in bind get fresh buffers named
        `prefix.name`); attrs: the call's attribute and dimension values; need: the outputs
        wanted (None = all): statements feeding none of them are dropped, so a backward skips
        gradients nobody uses; on: the stream the call's line names (`on S`), which wins over
        the op's own.  Fails (S002, S007, S015, and what a launch's type rule says) by _Abort.
        """
        streams = self.streams
        stdlib = self.scope.stdlib_like(op.name)
        rep = on or streams.placed(op.name, streams.stream(op.stream, stdlib))
        out_names = [o.name.id for o in op.outs]
        body = list(op.body) if need is None else _feeding(op.body, need)
        cx = Lowering(rep, rep, op_id, label, out, op, dict(bind), attrs, call_span, stdlib)
        env = cx.env
        stmt_index: dict[str, int] = {}
        pending_after: list[tuple[int, A.KernelStmt]] = []
        for st in body:
            stream = st.clauses.on and streams.stream(st.clauses.on, stdlib) or rep
            target0 = st.targets[0].id
            stream = streams.placed(f"{op.name}.{target0}", stream)
            into = None
            iv = st.clauses.into
            if iv is not None:
                if iv.id in {t.id for t in st.targets}:
                    self.fail("S015", f"`into {iv.id}` names this statement's own result", iv.span,
                              help="`into` names a parameter or an earlier result whose storage the result reuses")
                if iv.id not in env:
                    self.fail("S007", f"unknown buffer `{iv.id}` in `into`", iv.span)
                if not self.buffers.has(env[iv.id]):
                    if any(d.code == "S007" and d.span == iv.span for d in self.scope.sink.diags):
                        raise _Abort()  # the op's own check said so already (names.py): one mistake, one diagnostic
                    self.fail("S007", f"`into {iv.id}`: `{iv.id}` has no storage yet here: op `{op.name}` writes "
                              "it later (or not at all)", iv.span,
                              help="`into` names a parameter or an earlier result whose storage the result reuses")
                into = env[iv.id]
            outs = []
            for t in st.targets:
                if t.id in env and t.id not in out_names and t.id not in bind:
                    self.fail("S002", f"`{t.id}` is assigned twice in op `{op.name}`", t.span)
                if t.id not in env:
                    # A result placed into a per-slot buffer exists once per slot too (`x[a]`, `x[b]`).
                    env[t.id] = f"{prefix}.{t.id}" + (f"[{SLOT}]" if into is not None and SLOT in into else "")
                outs.append(env[t.id])
            first = len(out)
            self.lower_stmt(st, tuple(outs), into, evolve(cx, stream=stream))
            user = not stdlib
            # the user chose this stream: an `on` on a statement of their own op, or a `place` of
            # the op or the statement (the fusion pass never moves such a task to another stream)
            chosen = (user and st.clauses.on is not None) or f"{op.name}.{target0}" in self.scope.places \
                or op.name in self.scope.places
            for i in range(first, len(out)):
                # Only a user's op body has lines a fix can edit (an `after`, the removal of `into`).
                out[i] = evolve(out[i], site=Site(
                    op=target0 if user else "", op_tail=st.clauses.tail if user else None,
                    into_span=st.clauses.into_span if into is not None and user and i == len(out) - 1 else None,
                    op_afters=st.clauses.after_clauses if user else (), placed=chosen))
            stmt_index[target0] = len(out) - 1
            for t in st.targets[1:]:
                stmt_index[t.id] = len(out) - 1
            if st.clauses.after:
                pending_after.append((first, st))
        for first, st in pending_after:
            ids = []
            for r in st.clauses.after:
                nm = r.text
                if nm not in stmt_index:
                    self.fail("S007", f"`after {nm}`: no statement `{nm}` in op `{op.name}`", r.span,
                              help="`after` names an earlier statement of the same op body")
                ids.append(stmt_index[nm])
            t = out[first]
            out[first] = evolve(t, after=t.after + tuple(ids))
        return cx

    def kernel(self, func: A.Name):
        """The kernel record a call names; fails S014 for an unknown kernel (quietly for a
        `kernel` form of the file whose own mistakes were reported)."""
        kernels = self.scope.kernels
        if func.id not in kernels and func.id in self.scope.kernel_defs:
            raise _Abort()  # a `kernel` form whose mistakes were reported
        if func.id not in kernels:
            self.fail("S014", f"unknown kernel `{func.id}`", func.span, help=_KERNELS_HELP)
        return kernels[func.id]

    def lower_stmt(self, st: A.KernelStmt, outs: tuple[str, ...], into: str | None, cx: Lowering) -> None:
        """Append the launches of one body statement (its nested calls first) writing `outs`
        (into: the buffer whose storage they reuse, or None)."""
        e = st.expr
        if isinstance(e, A.Var):
            e = A.Call(A.Name("copy", e.span), (e,), (), e.span)
        if not isinstance(e, A.Call):
            e = as_call(self.scope.sink, e)
        kname = e.func.id
        k = self.kernel(e.func)
        if len(st.targets) != len(k.outputs):
            self.fail("S005", f"kernel `{kname}` produces {len(k.outputs)} value(s), {len(st.targets)} target(s) given",
                      st.span)
        args, attrs = self.lower_args(e, k, cx)
        self.emit(cx, kname, args, outs, attrs, st.targets[0].id, st.span, into=into)

    def lower_args(self, e: A.Call, k, cx: Lowering):
        """(argument buffers, sorted attribute items) of the kernel call `e` of kernel record `k`;
        nested calls among its arguments are lowered first, into temporaries."""
        if len(e.args) != len(k.inputs):
            self.fail("S005", f"kernel `{k.name}` takes {len(k.inputs)} argument(s) ({', '.join(k.inputs)}), "
                      f"{len(e.args)} given", e.span)
        attrs: dict[str, Any] = {}
        args = []
        for i, a in enumerate(e.args):
            if isinstance(a, A.Transpose):
                if k.name != "matmul" or i > 1:
                    self.fail("S015", "`^T` transposes a matmul argument only", a.span)
                attrs["ta" if i == 0 else "tb"] = True
                a = a.operand
            args.append(self.lower_value(a, cx))
        for kw in e.kwargs:
            if kw.name.id not in k.attrs:
                self.fail("S015", f"kernel `{k.name}` has no attribute `{kw.name.id}`", kw.name.span,
                          help=f"attributes: {', '.join(k.attrs) or 'none'}")
            attrs[kw.name.id] = const(self.scope.sink, kw.value, cx.attrs)
        return tuple(args), tuple(sorted(attrs.items()))

    def lower_value(self, a: A.Expr, cx: Lowering) -> str:
        """The buffer holding the value of argument `a`: a body name's buffer, or the temporary a
        nested single-output call is lowered into (recorded in cx.nested)."""
        if isinstance(a, A.Var):
            if a.name.id not in cx.env:
                self.fail("S007", f"unknown buffer `{a.name.id}` in op `{cx.op.name}`", a.name.span,
                          help="an op body reads its parameters and earlier statements' results")
            return cx.env[a.name.id]
        call = a if isinstance(a, A.Call) else as_call(self.scope.sink, a)
        k = self.kernel(call.func)
        if len(k.outputs) != 1:
            self.fail("S015", f"kernel `{k.name}` produces several values and cannot be nested", call.span)
        args, attrs = self.lower_args(call, k, cx)
        self._tmp += 1
        tmp = f"{cx.label.split(' ')[-1]}.t{self._tmp}"
        self.emit(cx, k.name, args, (tmp,), attrs, "", call.span)
        cx.nested[id(a)] = tmp  # a derived backward reads it
        return tmp

    def emit(self, cx: Lowering, kname: str, args: tuple[str, ...], outs: tuple[str, ...], attrs, stmt: str,
             span: Span | None, into: str | None = None, kind: str = "act") -> None:
        """Type-check one launch of kernel `kname` (args -> outs, attrs its sorted attribute
        items; span: where it is written), create its output buffers (of `kind`, temporaries as
        temp), make them reuse `into`'s storage, append its template (stmt: its statement's
        name) to cx.out.  Fails S002 (an output twice) and what the kernel's type rule raises
        (KernelTypeError's code)."""
        k = self.scope.kernels[kname]
        btype, has = self.buffers.btype, self.buffers.has
        stdlib, call_span = cx.stdlib, cx.call_span
        dup = next((o for i, o in enumerate(outs) if o in outs[:i]), None)
        if dup is not None:
            at = call_span if (stdlib and call_span is not None) else span
            self.fail("S002", f"two outputs of `{kname}` are the same buffer `{dup}`: one result would "
                      f"overwrite the other", at, help="pass a distinct buffer for each output")
        in_types = [btype(a) for a in args]
        all_attrs = {**k.attrs, **dict(attrs)}
        if not k.inputs and outs and has(outs[0]):
            shp, dt = btype(outs[0])
            all_attrs.update(shape=shp, dtype=dt)
            attrs = tuple(sorted({**dict(attrs), "shape": shp, "dtype": dt}.items()))
        try:
            out_types = k.infer(in_types, all_attrs)
        except KernelTypeError as exc:
            labels = []
            at = span
            if stdlib and call_span is not None:
                labels = [Label(span, f"in `{kname}` here")]
                at = call_span
            elif call_span is not None:
                labels = [Label(call_span, "used here")]
            msg = exc.message if exc.message.startswith(kname) else f"{kname}: {exc.message}"
            self.fail(exc.code, msg, at, labels=labels)
        for o, (shp, dt) in zip(outs, out_types):
            if has(o):
                have = btype(o)
                if have != (tuple(shp), dt):
                    code = "S004" if have[1] != dt else "S003"
                    at, labels = (call_span, [Label(span, "produced here")]) if stdlib and call_span else (span, [])
                    self.fail(code, f"`{o}` is {dt}{list(shp)} here but {have[1]}{list(have[0])} elsewhere", at,
                              labels=labels)
            else:
                for name in self.buffers.slotted(o):
                    self.buffers.add(name, shp, dt, "temp" if ".t" in o.rsplit(".", 1)[-1][:2] else kind, span)
        if into is not None:
            self.buffers.alias_into(outs, into, span, call_span if stdlib else None)
        # A task of a stdlib op points at the user's line that called the op.
        where = call_span if (stdlib and call_span is not None) else span
        cx.out.append(TaskTemplate(kname, cx.stream, tuple(args), tuple(outs), tuple(attrs), (), cx.op_id, cx.rep,
                                   stmt, f"{cx.label}.{stmt}" if stmt else cx.label, where))
