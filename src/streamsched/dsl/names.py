"""Names and scopes: the files' items collected into the `Scope` by name (each defined once),
stream names resolved and the stdlib's canonical streams folded onto the declared ones by role
(`Streams`), placements and op bodies checked where they are written, used or not.

Source: LANGUAGE.md ("Streams", "Ops", "Placement") and the seed's op-to-stream policy.
"""

from __future__ import annotations

import difflib

from streamsched.diagnostics import Label
from streamsched.dsl import ast as A
from streamsched.dsl.load import stdlib_file
from streamsched.dsl.scope import INITS, Scope, _Abort
from streamsched.dsl.types import is_dtype_var
from streamsched.interp.ir import DTYPE_BYTES, HOST, Span

ROLES = ("copy", "compute", "update")
LEGACY_STREAMS = ("default", "legacy", "null", "legacy_default", "nullstream")


def collect(scope: Scope) -> None:
    """Fill `scope` with the stdlib's ops and every item of its files, in file order; a name
    defined twice is S002 (the first definition stays), an unknown block S016, no streams S001."""
    err = scope.sink.err
    for op in stdlib_file().items:
        if isinstance(op, A.OpDef):
            scope.ops[op.name] = op
            scope.stdlib_ops.add(op.name)
    user_ops: dict[str, A.OpDef] = {}
    for f in scope.files:
        for item in f.items:
            if isinstance(item, A.Streams):
                for d in item.decls:
                    _declare_stream(scope, d)
            elif isinstance(item, A.OpDef):
                if item.name in user_ops:
                    err("S002", f"op `{item.name}` is defined twice", item.name_span,
                        labels=[Label(user_ops[item.name].name_span, "first defined here")])
                    continue
                user_ops[item.name] = item
                scope.ops[item.name] = item  # a user op shadows the stdlib op of that name
                scope.stdlib_ops.discard(item.name)
            elif isinstance(item, A.KernelDef):
                if item.name.id in scope.kernel_defs:
                    err("S002", f"kernel `{item.name.id}` is defined twice", item.name.span,
                        labels=[Label(scope.kernel_defs[item.name.id].name.span, "first defined here")])
                    continue
                scope.kernel_defs[item.name.id] = item
            elif isinstance(item, A.Place):
                scope.places[item.target] = item
            elif isinstance(item, A.ModelDef):
                _unique(scope, scope.models, item.name, item, "model")
            elif isinstance(item, A.GraphDef):
                _unique(scope, scope.graphs_ast, item.name, item, "graph")
            elif isinstance(item, A.StepDef):
                if scope.steps:
                    err("S002", f"a second step `{item.name.id}`: v1 runs one step per file",
                        item.name.span, labels=[Label(scope.steps[0].name.span, "first step here")])
                    continue
                scope.steps.append(item)
            elif isinstance(item, A.TrainBlock):
                if item.name.id != "train":
                    guess = difflib.get_close_matches(item.name.id.lower(), ["train", "streams", "state"], n=1,
                                                      cutoff=0.6)
                    err("S016", f"unknown block `{item.name.id}`", item.name.span,
                        help=(f"did you mean `{guess[0]} {{`? " if guess else "") +
                        "top-level blocks are streams, state, op, place, model, graph, step, train, barriers, include")
                    continue
                if scope.train is not None:
                    err("S002", "the `train` block appears twice", item.name.span)
                    continue
                scope.train = item
            elif isinstance(item, A.Barriers):
                scope.barriers = item
            elif isinstance(item, A.StateBlock):
                for d in item.decls:
                    _unique(scope, scope.state_decls, d.name, d, "state")
    if not scope.streams and not any(isinstance(i, A.Streams) for f in scope.files for i in f.items):
        if scope.files and scope.files[-1].items:
            first = scope.files[-1].items[0].span
        else:  # an empty file (or only comments): the file's first character, so its name is shown
            first = Span(scope.files[-1].path, 1, 1, 1, 1) if scope.files else None
        err("S001", "no streams are declared", first, help="declare them first: `streams { comp1 : compute }`")


def _unique(scope: Scope, table: dict, name: A.Name, item, what: str) -> None:
    if name.id in table:
        scope.sink.err("S002", f"{what} `{name.id}` is defined twice", name.span,
                       labels=[Label(table[name.id].name.span, "first defined here")])
    else:
        table[name.id] = item


def _declare_stream(scope: Scope, d: A.StreamDecl) -> None:
    err = scope.sink.err
    if d.name.id in LEGACY_STREAMS:
        err("C001", f"`{d.name.id}` names the legacy default stream, which streamsched never uses",
            d.name.span, help="declare a named stream instead; every stream is created non-blocking")
        return
    if d.name.id == HOST:
        err("S002", "`host` is the implicit stream of the CPU thread and cannot be declared", d.name.span)
        return
    if d.role.id not in ROLES:
        err("S015", f"unknown stream role `{d.role.id}`", d.role.span, help=f"roles are {', '.join(ROLES)}")
        return
    if d.name.id in scope.streams:
        err("S002", f"stream `{d.name.id}` is declared twice", d.name.span,
            labels=[Label(scope.streams[d.name.id][1], "first declared here")])
        return
    scope.streams[d.name.id] = (d.role.id, d.name.span)


class Streams:
    """Stream names to declared streams: a user's name must be declared; the stdlib's canonical
    names (`comp1`, `comp2`, `update`, `trans`) fold onto the declared streams by role; a
    `place` line moves an op or one of its statements."""

    def __init__(self, scope: Scope):
        self.scope = scope
        self.fail = scope.sink.fail

    def stream(self, name: A.Name, stdlib: bool) -> str:
        """A declared stream; stdlib placements fold onto the declared streams by role.  Fails
        (C001 legacy stream, S001 host or unknown stream)."""
        streams = self.scope.streams
        if name is None:  # an op without `on` (S015, reported by check_ops): its kernels on comp1's role
            if not streams:
                raise _Abort()
            return self.fold("comp1")
        n = name.id
        if n in streams:
            return n
        if n in LEGACY_STREAMS:
            self.fail("C001", f"`{n}` is the legacy default stream, which streamsched never uses", name.span,
                      help="name a declared stream; the legacy stream synchronizes with every blocking stream")
        if n == HOST:
            self.fail("S001", "`host` is the CPU thread: kernels cannot run on it", name.span)
        if stdlib and streams:
            return self.fold(n)
        if not streams:
            raise _Abort()  # "no streams are declared" was reported once already
        known = ", ".join(streams)
        self.fail("S001", f"unknown stream `{n}`", name.span, help=f"declared streams: {known}")
        return ""

    def fold(self, canonical: str) -> str:
        """The declared stream a stdlib canonical stream name runs on (its role's streams in
        declaration order; compute streams stand in for a missing role)."""
        streams = self.scope.streams
        by_role = {r: [s for s, (role, _) in streams.items() if role == r] for r in ROLES}
        compute = by_role["compute"] or list(streams)
        if canonical.startswith("comp") and canonical[4:].isdigit():
            i = int(canonical[4:]) - 1
            return compute[min(i, len(compute) - 1)]
        if canonical == "update":
            return (by_role["update"] or compute)[0]
        if canonical == "trans":
            return (by_role["copy"] or compute)[0]
        return compute[0]

    def placed(self, target: str, default: str) -> str:
        """The stream of `place TARGET on S` (an op, or `OP.STMT`), else `default`."""
        p = self.scope.places.get(target)
        if p is not None:
            return self.stream(p.stream, stdlib=False)
        return default


def check_places(scope: Scope, streams: Streams) -> None:
    """`place OP on S` and `place OP.STMT on S` must name an op (and one of its statements)
    and a declared stream; a placement that matches nothing would silently do nothing."""
    from streamsched.dsl.compose import composite_ops

    fail = scope.sink.fail
    blocks = composite_ops(scope)
    for target, pl in scope.places.items():
        try:
            streams.stream(pl.stream, stdlib=False)
            if target in scope.ops:
                continue
            op_name, _, stmt = target.rpartition(".")
            op = scope.ops.get(op_name)
            if (op is None or stmt not in {t.id for st in op.body for t in st.targets}) and \
                    derived_place_ok(scope, target):
                continue  # the backward derived for an op without one, or one of its statements
            if op is None and target.split(".")[0] not in scope.ops and ("." in target or blocks):
                # one line of a block instance (`h.2.k`), or a block call's output line (`h`)
                scope.line_places[target] = pl  # maybe one line of a block instance: compose decides
                continue
            if op is None:
                fail("S006", f"`place {target}`: no op `{target}`", pl.target_span,
                     help="place an op (`place relu on comp1`) or one statement of it "
                          "(`place linear.backward.db on comp3`)")
            names = [t.id for st in op.body for t in st.targets]
            if stmt not in names:
                fail("S007", f"`place {target}`: op `{op_name}` has no statement `{stmt}`",
                     pl.target_span, help=f"its statements: {', '.join(names)}")
        except _Abort:
            continue


def derived_place_ok(scope: Scope, target: str) -> bool:
    """`place NAME.backward on S` / `place NAME.backward.dX on S` for an op without a written
    backward (derived later, when a model trains through it, by dsl/derive.py): dX names an
    input or parameter."""
    head, _, last = target.rpartition(".")
    if target.endswith(".backward") and target[:-9] in scope.ops:
        return True
    if head.endswith(".backward") and head[:-9] in scope.ops and head not in scope.ops and last.startswith("d"):
        op = scope.ops[head[:-9]]
        return last[1:] in {p.name.id for p in op.params}
    return False


def check_ops(scope: Scope, streams: Streams) -> None:
    """Check every user op body once, where it is defined, used or not: its streams, the names
    it reads, its outputs assigned, its signature's types and inits, its kernels known."""
    # (Type-free: op parameters without types have no shapes; only names and streams are checked.)
    from streamsched.dsl.compose import composite_ops

    err = scope.sink.err
    blocks = composite_ops(scope)
    for op in scope.ops.values():
        if op.name in scope.stdlib_ops:
            continue
        try:
            block = op.name in blocks
            if op.stream:
                streams.stream(op.stream, False)
            elif not block:
                out0 = op.outs[0].name.id if op.outs else "y"
                err("S015", f"op `{op.name}` needs a stream: its kernels run on one", op.name_span or op.span,
                    help=f"give it one after its outputs: `-> {out0} on comp1 {{`")
            assigned = {t.id for st in op.body for t in st.targets}
            for o in op.outs:
                if o.name.id not in assigned and o.name.id not in {p.name.id for p in op.params}:
                    err("S007", f"op `{op.name}` never assigns its output `{o.name.id}`", o.span,
                        help=f"add a statement `{o.name.id} = ...` to its body")
            _check_signature(scope, op)
            defined = {p.name.id for p in op.params}
            inputs = {p.name.id for p in op.params}
            composite = block
            for st in op.body:
                if st.clauses.on is not None:
                    streams.stream(st.clauses.on, False)
                for n in expr_names(st.expr, kwargs=block):
                    if block and "." in n:  # `s.w`: a parameter of the block's own statement s
                        head = n.split(".", 1)[0]
                        if head not in defined or head in inputs:
                            err("S007", f"`{n}`: a block names parameters of its own statements only, and `{head}` "
                                f"is no earlier statement of `{op.name}`", _find_var(st.expr, n) or st.span,
                                help="tie to a statement of the block (`s.w`), or pass the value as an input")
                    elif n not in defined:
                        err("S007", f"unknown buffer `{n}` in op `{op.name}`", _find_var(st.expr, n) or st.span,
                            help=(f"a block sees its inputs, its statements and its attributes: for a model's "
                                  f"parameter, add `{n} = 1` to `op {op.name}(...)`'s parameters and pass "
                                  f"`{n} = {n}` where the model calls it") if block else "")
                if st.clauses.into is not None and st.clauses.into.id not in defined and \
                        st.clauses.into.id not in {t.id for t in st.targets}:  # (that one is S015)
                    err("S007", f"unknown buffer `{st.clauses.into.id}` in `into`", st.clauses.into.span,
                        help="`into` names a parameter or an earlier result of the same op")
                for t in st.targets:
                    defined.add(t.id)
                if not composite:  # a block's statements call ops (dsl/compose.py checks them where used)
                    _check_kernel_names(scope, st.expr)
        except _Abort:
            continue


def _check_signature(scope: Scope, op: A.OpDef) -> None:
    """The types and inits of an op's signature, checked where it is defined (used or not):
    known dtypes or dtype variables, a bare dtype only on an optimizer's state, known inits."""
    err = scope.sink.err
    optimizer = any(p.modifier in ("grad", "param") for p in op.params)  # may run per parameter
    bound = {p.type.dtype.id for p in op.params if p.modifier is None and p.type is not None}
    for p in list(op.params) + [o for o in op.outs]:
        t = getattr(p, "type", None)
        if t is not None:
            if is_dtype_var(t.dtype.id) and t.dtype.id not in bound:
                err("S004", f"the dtype variable `{t.dtype.id}` is not bound by any input", t.dtype.span,
                    help="a dtype variable takes the dtype of the typed input it first appears in")
            elif not is_dtype_var(t.dtype.id) and t.dtype.id not in DTYPE_BYTES:
                err("S015", f"unknown dtype `{t.dtype.id}`", t.dtype.span,
                    help=f"dtypes: {', '.join(DTYPE_BYTES)}; a single capital letter (`T`) is a dtype variable")
            elif t.dims is None and not (optimizer and getattr(p, "modifier", None) == "state"):
                err("S015", f"`{t.dtype.id}` needs a shape here: `{t.dtype.id}[...]` (`{t.dtype.id}[]` for a "
                    "scalar)", t.span, help="a bare dtype is only the type of an optimizer's state")
        mod = getattr(p, "modifier", None)
        default = getattr(p, "default", None)
        if mod in ("param", "state") and isinstance(default, A.Var):
            ok = INITS + (("copy",) if mod == "state" and optimizer else ())
            if default.name.id not in ok:
                err("S015", f"unknown init `{default.name.id}`", default.span, help=f"inits: {', '.join(ok)}")


def _find_var(e: A.Expr, n: str) -> Span | None:
    if isinstance(e, A.Var) and e.name.id == n:
        return e.name.span
    kw = tuple(k.value for k in (getattr(e, "kwargs", ()) or ()))
    for ch in (getattr(e, "args", ()) or ()) + kw + tuple(x for x in (getattr(e, "left", None), getattr(e, "right", None),
                                                                      getattr(e, "operand", None)) if x is not None):
        s = _find_var(ch, n)
        if s:
            return s
    return None


def _check_kernel_names(scope: Scope, e: A.Expr) -> None:
    kernels = scope.kernels
    if isinstance(e, A.Call):
        if e.func.id not in kernels and e.func.id not in scope.kernel_defs:
            guess = difflib.get_close_matches(e.func.id, list(kernels) + list(scope.kernel_defs) + list(scope.ops), n=1)
            scope.sink.err("S014", f"unknown kernel `{e.func.id}`", e.func.span,
                           help=(f"did you mean `{guess[0]}`? " if guess else "") +
                           "kernels are the stdlib primitives listed in docs/kernels.md, the file's `kernel` "
                           "forms and those of `--kernels` modules")
        for a in e.args:
            _check_kernel_names(scope, a)
    elif isinstance(e, A.BinOp):
        _check_kernel_names(scope, e.left)
        _check_kernel_names(scope, e.right)
    elif isinstance(e, (A.Neg, A.Transpose)):
        _check_kernel_names(scope, e.operand)


def expr_names(e: A.Expr, kwargs: bool = False) -> set[str]:
    """The buffer names an op-body expression reads (with `kwargs`, named arguments' too: a
    block's attributes and tied parameters)."""
    if isinstance(e, A.Var):
        return {e.name.id}
    if isinstance(e, A.Call):
        out: set[str] = set()
        for a in e.args:
            out |= expr_names(a, kwargs)
        if kwargs:
            for k in e.kwargs:
                out |= expr_names(k.value, kwargs)
        return out
    if isinstance(e, A.BinOp):
        return expr_names(e.left, kwargs) | expr_names(e.right, kwargs)
    if isinstance(e, (A.Neg, A.Transpose)):
        return expr_names(e.operand, kwargs)
    return set()
