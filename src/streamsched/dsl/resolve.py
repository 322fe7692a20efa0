"""AST to typed program: names, stdlib ops, shapes and dtypes, ops expanded into task
templates (one kernel launch each), the backward pass derived from `NAME.backward` ops, graphs
and the step resolved.  User mistakes become S/C diagnostics, all collected, never exceptions.

Source: LANGUAGE.md (the forms and their meaning) and the seed's op-to-stream policy.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from streamsched.diagnostics import Diagnostic, Label, SourceCache, StreamschedError
from streamsched.dsl import ast as A
from streamsched.dsl.derive import derive_op_backward, derived_place_ok
from streamsched.dsl.kernels import compile_kernel_defs, kernel_as_op_help
from streamsched.dsl.load import STDLIB_PATH, load_program_files, stdlib_file
from streamsched.dsl.program import SLOT, AfterRef, GraphInfo, Launch, ModelInfo, Program, TaskTemplate
from streamsched.interp.fixes import drop_ref
from streamsched.interp.ir import DTYPE_BYTES, HOST, Buffer, Site, Span
from streamsched.stdlib.kernel_record import KernelTypeError

ROLES = ("copy", "compute", "update")
LEGACY_STREAMS = ("default", "legacy", "null", "legacy_default", "nullstream")
POLICIES = ("auto", "chain", "explicit")
CAPTURES = ("none", "graphs", "step")
INITS = ("zeros", "ones", "glorot", "he", "normal", "uniform")
KNOWN_HOST_VALUES = ("lr", "step")
FLOAT_DTYPES = ("f16", "bf16", "f32", "f64")


# The values an integer or float state can start at (finite; f16's largest is 65504).
_DTYPE_RANGE = {"i8": (-2 ** 7, 2 ** 7 - 1), "u8": (0, 2 ** 8 - 1), "i16": (-2 ** 15, 2 ** 15 - 1),
                "i32": (-2 ** 31, 2 ** 31 - 1), "i64": (-2 ** 63, 2 ** 63 - 1),
                "f16": (-65504.0, 65504.0), "bf16": (-3.38e38, 3.38e38), "f32": (-3.4028234e38, 3.4028234e38)}


def grad_name(buf: str) -> str:
    """The buffer holding the gradient of activation `buf`: `d(h1)`.  Parentheses never occur in a
    name a user writes (`value` or `value.output`), so these never collide with the user's."""
    return f"d({buf})"


SEED = grad_name("loss")
"""The backward's seed d(loss) = 1 (a constant buffer), or the loss scale under `backward M * S`."""


def is_dtype_var(name: str) -> bool:
    """A dtype variable in an op signature is a single capital letter (`x : T[n, k]`): it binds to
    the dtype of the first typed input it appears in, as dimension variables bind to sizes."""
    return len(name) == 1 and "A" <= name <= "Z"
TRAIN_KEYS = ("model", "data", "epochs", "lr", "capture", "barriers", "seed", "log")


@dataclass(frozen=True)
class CallValue:
    """A call written as a value in the `train` block: `digits(test = 0.2)`, `cosine(0.1)`."""

    name: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    span: Span | None = None


class _Abort(Exception):
    """Stops expanding one construct after a diagnostic was recorded."""


def _kernels():
    from streamsched.stdlib.kernels import KERNELS

    return KERNELS


@dataclass
class _Call:
    """One forward op call of a model (kept for the backward derivation)."""

    op: A.OpDef
    bind: dict[str, str]  # op param/out name -> buffer
    attrs: dict[str, Any]
    inputs: tuple[str, ...]  # op names of buffer inputs (not params)
    params: tuple[str, ...]  # op names of parameter inputs
    outs: tuple[str, ...]
    span: Span | None
    label: str
    inner_env: dict[str, str] = field(default_factory=dict)  # body statement targets -> buffers
    inner_nodes: dict[int, str] = field(default_factory=dict)  # id(nested AST call) -> its temporary


class Resolver:
    """One resolution run; `resolve()` below is the entry point."""

    def __init__(self, files: list[A.File], kernels=None):
        self.files = files
        # This program's kernels: the stdlib's, the `--kernels` modules' and the file's `kernel`
        # forms (and the gradient kernels derived from them), never shared with another file.
        self.kernels: dict[str, Any] = {**_kernels(), **dict(kernels or {})}
        self.kernel_origins: dict[str, str] = dict(getattr(kernels, "origins", {}) or {})
        self.kernel_defs: dict[str, A.KernelDef] = {}
        self.kernel_sources: dict[str, Any] = {}  # user kernel -> dsl.kernels.KernelSource
        self.derived_ops: set[str] = set()  # synthesized NAME.backward ops (lines nobody can edit)
        self.nested_values: dict[int, str] = {}  # id(nested call in an op body) -> its temporary
        self.last_env: dict[str, str] = {}  # the last expanded op body's names -> buffers
        self.diags: list[Diagnostic] = []
        self.streams: dict[str, tuple[str, Span | None]] = {}
        self.ops: dict[str, A.OpDef] = {}
        self.stdlib_ops: set[str] = set()
        self.places: dict[str, A.Place] = {}
        self.models: dict[str, A.ModelDef] = {}
        self.graphs_ast: dict[str, A.GraphDef] = {}
        self.steps: list[A.StepDef] = []
        self.train: A.TrainBlock | None = None
        self.barriers: A.Barriers | None = None
        self.buffers: dict[str, Buffer] = {}
        self.inits: dict[str, str] = {}
        self.uploads: set[str] = set()
        self.slots: tuple[str, ...] = ()
        self.model_info: ModelInfo | None = None
        self._tmp = 0
        self._poisoned: set[str] = set()
        self.broken_models: set[str] = set()  # models whose mistakes were reported; no follow-ups
        self.runs: dict[str, Span | None] = {}  # ForwardStmt / BackwardStmt / optimizer -> a span
        self.graph_runs: dict[str, dict[str, Span | None]] = {}  # the same, per graph
        self.state_decls: dict[str, A.StateDecl] = {}  # `state { NAME : TYPE = INIT }`
        self.loss_scale = ""  # the device scalar a `backward M * S` seeds the backward with
        self.broken_states: set[str] = set()  # `state` declarations that failed (reported once)

    # ------------------------------------------------------------------ helpers
    def err(self, code: str, msg: str, span: Span | None, help: str = "", labels=(), notes=(), fixes=()) -> None:
        d = Diagnostic(code, msg, span, help=help, labels=tuple(labels), notes=tuple(notes), fixes=tuple(fixes))
        if d not in self.diags:  # one mistake seen from two places (its definition and a use) once
            self.diags.append(d)

    def fail(self, code: str, msg: str, span: Span | None, help: str = "", labels=()) -> None:
        self.err(code, msg, span, help, labels)
        raise _Abort()

    def add_buffer(self, name: str, shape, dtype: str, kind: str, span=None, space="device", init=None) -> Buffer:
        if name in self.buffers:
            return self.buffers[name]
        b = Buffer(name, tuple(int(d) for d in shape), dtype, space=space, kind=kind, span=span)
        self.buffers[name] = b
        if init:
            self.inits[name] = init
        return b

    def slotted(self, name: str) -> list[str]:
        """The concrete buffer names a (possibly slotted) template name stands for."""
        if SLOT in name:
            return [name.replace(SLOT, s) for s in self.slots]
        return [name]

    def btype(self, name: str, span: Span | None = None) -> tuple[tuple[int, ...], str]:
        b = self.buffers.get(self.slotted(name)[0])
        if b is None:
            # A value an earlier mistake failed to produce (that mistake was reported).
            if not self.diags:
                self.err("S007", f"`{name}` has no value here", span)
            raise _Abort()
        return b.shape, b.dtype

    # ------------------------------------------------------------------ collection
    def collect(self) -> None:
        for op in stdlib_file().items:
            if isinstance(op, A.OpDef):
                self.ops[op.name] = op
                self.stdlib_ops.add(op.name)
        user_ops: dict[str, A.OpDef] = {}
        for f in self.files:
            for item in f.items:
                if isinstance(item, A.Streams):
                    for d in item.decls:
                        self.declare_stream(d)
                elif isinstance(item, A.OpDef):
                    if item.name in user_ops:
                        self.err("S002", f"op `{item.name}` is defined twice", item.name_span,
                                 labels=[Label(user_ops[item.name].name_span, "first defined here")])
                        continue
                    user_ops[item.name] = item
                    self.ops[item.name] = item  # a user op shadows the stdlib op of that name
                    self.stdlib_ops.discard(item.name)
                elif isinstance(item, A.KernelDef):
                    if item.name.id in self.kernel_defs:
                        self.err("S002", f"kernel `{item.name.id}` is defined twice", item.name.span,
                                 labels=[Label(self.kernel_defs[item.name.id].name.span, "first defined here")])
                        continue
                    self.kernel_defs[item.name.id] = item
                elif isinstance(item, A.Place):
                    self.places[item.target] = item
                elif isinstance(item, A.ModelDef):
                    self.unique(self.models, item.name, item, "model")
                elif isinstance(item, A.GraphDef):
                    self.unique(self.graphs_ast, item.name, item, "graph")
                elif isinstance(item, A.StepDef):
                    if self.steps:
                        self.err("S002", f"a second step `{item.name.id}`: v1 runs one step per file",
                                 item.name.span, labels=[Label(self.steps[0].name.span, "first step here")])
                        continue
                    self.steps.append(item)
                elif isinstance(item, A.TrainBlock):
                    if item.name.id != "train":
                        guess = difflib.get_close_matches(item.name.id.lower(), ["train", "streams", "state"], n=1,
                                                          cutoff=0.6)
                        self.err("S016", f"unknown block `{item.name.id}`", item.name.span,
                                 help=(f"did you mean `{guess[0]} {{`? " if guess else "") +
                                 "top-level blocks are streams, state, op, place, model, graph, step, train, barriers, include")
                        continue
                    if self.train is not None:
                        self.err("S002", "the `train` block appears twice", item.name.span)
                        continue
                    self.train = item
                elif isinstance(item, A.Barriers):
                    self.barriers = item
                elif isinstance(item, A.StateBlock):
                    for d in item.decls:
                        self.unique(self.state_decls, d.name, d, "state")
        if not self.streams and not any(isinstance(i, A.Streams) for f in self.files for i in f.items):
            first = self.files[-1].items[0].span if self.files and self.files[-1].items else None
            self.err("S001", "no streams are declared", first,
                     help="declare them first: `streams { comp1 : compute }`")

    def check_places(self) -> None:
        """`place OP on S` and `place OP.STMT on S` must name an op (and one of its statements)
        and a declared stream; a placement that matches nothing would silently do nothing."""
        for target, pl in self.places.items():
            try:
                self.stream(pl.stream, stdlib=False)
                if target in self.ops:
                    continue
                op_name, _, stmt = target.rpartition(".")
                op = self.ops.get(op_name)
                if (op is None or stmt not in {t.id for st in op.body for t in st.targets}) and \
                        derived_place_ok(self, target):
                    continue  # the backward derived for an op without one, or one of its statements
                if op is None:
                    self.fail("S006", f"`place {target}`: no op `{target}`", pl.target_span,
                              help="place an op (`place relu on comp1`) or one statement of it "
                                   "(`place linear.backward.db on comp3`)")
                names = [t.id for st in op.body for t in st.targets]
                if stmt not in names:
                    self.fail("S007", f"`place {target}`: op `{op_name}` has no statement `{stmt}`",
                              pl.target_span, help=f"its statements: {', '.join(names)}")
            except _Abort:
                continue

    def unique(self, table: dict, name: A.Name, item, what: str) -> None:
        if name.id in table:
            self.err("S002", f"{what} `{name.id}` is defined twice", name.span,
                     labels=[Label(table[name.id].name.span, "first defined here")])
        else:
            table[name.id] = item

    def declare_stream(self, d: A.StreamDecl) -> None:
        if d.name.id in LEGACY_STREAMS:
            self.err("C001", f"`{d.name.id}` names the legacy default stream, which streamsched never uses",
                     d.name.span, help="declare a named stream instead; every stream is created non-blocking")
            return
        if d.name.id == HOST:
            self.err("S002", "`host` is the implicit stream of the CPU thread and cannot be declared", d.name.span)
            return
        if d.role.id not in ROLES:
            self.err("S015", f"unknown stream role `{d.role.id}`", d.role.span,
                     help=f"roles are {', '.join(ROLES)}")
            return
        if d.name.id in self.streams:
            self.err("S002", f"stream `{d.name.id}` is declared twice", d.name.span,
                     labels=[Label(self.streams[d.name.id][1], "first declared here")])
            return
        self.streams[d.name.id] = (d.role.id, d.name.span)

    # ------------------------------------------------------------------ streams
    def stream(self, name: A.Name, stdlib: bool) -> str:
        """A declared stream; stdlib placements fold onto the declared streams by role."""
        n = name.id
        if n in self.streams:
            return n
        if n in LEGACY_STREAMS:
            self.fail("C001", f"`{n}` is the legacy default stream, which streamsched never uses", name.span,
                      help="name a declared stream; the legacy stream synchronizes with every blocking stream")
        if n == HOST:
            self.fail("S001", "`host` is the CPU thread: kernels cannot run on it", name.span)
        if stdlib and self.streams:
            return self.fold(n)
        if not self.streams:
            raise _Abort()  # "no streams are declared" was reported once already
        known = ", ".join(self.streams)
        self.fail("S001", f"unknown stream `{n}`", name.span, help=f"declared streams: {known}")
        return ""

    def fold(self, canonical: str) -> str:
        by_role = {r: [s for s, (role, _) in self.streams.items() if role == r] for r in ROLES}
        compute = by_role["compute"] or list(self.streams)
        if canonical.startswith("comp") and canonical[4:].isdigit():
            i = int(canonical[4:]) - 1
            return compute[min(i, len(compute) - 1)]
        if canonical == "update":
            return (by_role["update"] or compute)[0]
        if canonical == "trans":
            return (by_role["copy"] or compute)[0]
        return compute[0]

    def placed(self, target: str, default: str, stdlib: bool) -> str:
        p = self.places.get(target)
        if p is not None:
            return self.stream(p.stream, stdlib=False)
        return default

    # ------------------------------------------------------------------ constants
    def const(self, e: A.Expr, env: dict[str, Any]) -> Any:
        if isinstance(e, A.Num):
            return e.value
        if isinstance(e, A.Str):
            return e.value
        if isinstance(e, A.Var):
            if e.name.id in env:
                return env[e.name.id]
            if e.name.id in ("true", "false"):
                return e.name.id == "true"
            self.fail("S007", f"unknown name `{e.name.id}`", e.name.span,
                      help=("known here: " + ", ".join(sorted(env))) if env else "")
        if isinstance(e, A.Neg):
            return -self.const(e.operand, env)
        if isinstance(e, A.BinOp):
            a, b = self.const(e.left, env), self.const(e.right, env)
            try:
                return {"+": a + b, "-": a - b, "*": a * b}[e.op] if e.op != "/" else (a // b if isinstance(a, int) and isinstance(b, int) and a % b == 0 else a / b)
            except (TypeError, ZeroDivisionError):
                self.fail("S015", "this expression is not a constant", e.span)
        self.fail("S015", "a constant is expected here", e.span)

    # ------------------------------------------------------------------ op expansion
    def classify(self, op: A.OpDef):
        """(inputs, params, grads, states, attrs) of an op, each a list of OpParam."""
        ins, params, grads, states, attrs = [], [], [], [], []
        for p in op.params:
            if p.modifier == "param":
                params.append(p)
            elif p.modifier == "grad":
                grads.append(p)
            elif p.modifier == "state":
                states.append(p)
            elif p.default is not None and p.type is None:
                attrs.append(p)
            else:
                ins.append(p)
        return ins, params, grads, states, attrs

    def unify(self, t: A.TypeExpr, actual: tuple[tuple[int, ...], str], dims: dict[str, int], what: str,
              at: Span | None, decl: Span | None, code_shape="S003") -> None:
        shape, dtype = actual
        if is_dtype_var(t.dtype.id):
            key = "$" + t.dtype.id
            if key not in dims:
                if dtype not in FLOAT_DTYPES:
                    self.fail("S004", f"{what} has dtype {dtype}, but the dtype variable `{t.dtype.id}` stands "
                              f"for a float dtype ({', '.join(FLOAT_DTYPES)})", at,
                              labels=[Label(decl, "required here")] if decl else [])
                dims[key] = dtype
            elif dims[key] != dtype:
                self.fail("S004", f"{what} has dtype {dtype}, but `{t.dtype.id}` is {dims[key]} (bound by an "
                          f"earlier argument)", at, labels=[Label(decl, "required here")] if decl else [])
        elif t.dtype.id not in DTYPE_BYTES:
            self.type_dtype(t, dims)  # S015: unknown dtype
        elif t.dtype.id != dtype:
            self.fail("S004", f"{what} has dtype {dtype}, but `{t.dtype.id}` is required",
                      at, labels=[Label(decl, "required here")] if decl else [],
                      help="labels are integer class indices (i32)" if t.dtype.id.startswith("i") else "")
        if t.dims is None:
            return
        if len(t.dims) != len(shape):
            self.fail(code_shape, f"{what} has shape {list(shape)}, but {len(t.dims)} dimensions are required",
                      at, labels=[Label(decl, "declared here")] if decl else [])
        for d, actual_d in zip(t.dims, shape):
            if isinstance(d, A.Var) and d.name.id not in dims:
                dims[d.name.id] = actual_d
                continue
            want = self.const(d, dims)
            if want != actual_d:
                why = (f"`{d.name.id}` is {want} (bound by an earlier argument)" if isinstance(d, A.Var)
                       else f"it needs {want}")
                self.fail(code_shape, f"{what} has shape {list(shape)}, but `{_type_text(t)}` does not fit: "
                          f"{why}, not {actual_d}", at,
                          labels=[Label(decl, "declared here")] if decl else [])

    def type_dtype(self, t: A.TypeExpr, dims: dict[str, Any]) -> str:
        """The dtype of `t`: a known dtype, or a dtype variable (`T`) bound in `dims`."""
        if is_dtype_var(t.dtype.id):
            if "$" + t.dtype.id not in dims:
                self.fail("S004", f"the dtype variable `{t.dtype.id}` is not bound by any input", t.dtype.span,
                          help="a dtype variable takes the dtype of the typed input it first appears in")
            return dims["$" + t.dtype.id]
        if t.dtype.id not in DTYPE_BYTES:
            self.fail("S015", f"unknown dtype `{t.dtype.id}`", t.dtype.span,
                      help=f"dtypes: {', '.join(DTYPE_BYTES)}; a single capital letter (`T`) is a dtype variable")
        if t.dtype.id == "bf16":
            self.fail("S004", "bf16 buffers cannot run: neither backend has a bfloat16 array type (NumPy, CuPy)",
                      t.dtype.span, help="use f16 for mixed precision")
        return t.dtype.id

    def type_shape(self, t: A.TypeExpr, dims: dict[str, Any]) -> tuple[tuple[int, ...], str]:
        dtype = self.type_dtype(t, dims)
        if t.dims is None:
            self.fail("S015", f"`{t.dtype.id}` needs a shape here: `{t.dtype.id}[...]` (`{t.dtype.id}[]` for a scalar)",
                      t.span)
        shape = []
        for d in t.dims:
            v = self.const(d, dims)
            if not isinstance(v, int) or v <= 0:
                self.fail("S003", f"dimension must be a positive integer, got {v!r}", d.span)
            shape.append(v)
        return tuple(shape), dtype

    def expand_op(self, op: A.OpDef, bind: dict[str, str], attrs: dict[str, Any], out: list[TaskTemplate],
                  op_id: int, prefix: str, label: str, call_span: Span | None, need: set[str] | None = None,
                  on: str | None = None) -> None:
        """Append the templates of one op call to `out`.

        bind: op param/out name -> buffer name (outputs not in bind get fresh buffers named
        `prefix.name`); need: the outputs wanted (None = all); statements feeding none of them are
        dropped, so a backward skips gradients nobody uses.
        """
        stdlib = op.name in self.stdlib_ops or op.name in self.derived_ops
        rep = on or self.placed(op.name, self.stream(op.stream, stdlib), stdlib)
        out_names = [o.name.id for o in op.outs]
        body = list(op.body)
        if need is not None:
            wanted = set(need)
            keep = []
            for st in reversed(body):
                if any(t.id in wanted for t in st.targets):
                    keep.append(st)
                    wanted |= _expr_names(st.expr)
            keep_ids = {id(s) for s in keep}
            body = [s for s in body if id(s) in keep_ids]
        env = dict(bind)
        stmt_index: dict[str, int] = {}
        pending_after: list[tuple[int, A.KernelStmt]] = []
        for st in body:
            stream = st.clauses.on and self.stream(st.clauses.on, stdlib) or rep
            target0 = st.targets[0].id
            stream = self.placed(f"{op.name}.{target0}", stream, stdlib)
            into = None
            if st.clauses.into is not None:
                if st.clauses.into.id in {t.id for t in st.targets}:
                    self.fail("S015", f"`into {st.clauses.into.id}` names this statement's own result", st.clauses.into.span,
                              help="`into` names a parameter or an earlier result whose storage the result reuses")
                if st.clauses.into.id not in env or st.clauses.into.id == "__attrs__":
                    self.fail("S007", f"unknown buffer `{st.clauses.into.id}` in `into`", st.clauses.into.span)
                into = env[st.clauses.into.id]
            outs = []
            for t in st.targets:
                if t.id in env and t.id not in out_names and t.id not in bind:
                    self.fail("S002", f"`{t.id}` is assigned twice in op `{op.name}`", t.span)
                if t.id not in env:
                    # A result placed into a per-slot buffer exists once per slot too (`x[a]`, `x[b]`).
                    env[t.id] = f"{prefix}.{t.id}" + (f"[{SLOT}]" if into is not None and SLOT in into else "")
                outs.append(env[t.id])
            first = len(out)
            self.lower_stmt(st, env, outs, stream, into, out, op_id, rep, label, call_span, stdlib, op)
            user = not stdlib
            for i in range(first, len(out)):
                out[i] = replace(out[i], site=Site(op=target0 if user else "", op_tail=st.clauses.tail if user else None,
                                                   into_span=st.clauses.into_span if into is not None and user
                                                   and i == len(out) - 1 else None,
                                                   op_afters=st.clauses.after_clauses if user else ()))
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
            out[first] = replace(t, after=t.after + tuple(ids))
        self.last_env = env

    def lower_stmt(self, st: A.KernelStmt, env, outs, stream, into, out, op_id, rep, label, call_span, stdlib, op) -> None:
        kernels = self.kernels
        e = st.expr
        if isinstance(e, A.Var):
            e = A.Call(A.Name("copy", e.span), (e,), (), e.span)
        if not isinstance(e, A.Call):
            e = self.binop_call(e)
        kname = e.func.id
        if kname not in kernels and kname in self.kernel_defs:
            raise _Abort()  # a `kernel` form whose mistakes were reported
        if kname not in kernels:
            self.fail("S014", f"unknown kernel `{kname}`", e.func.span,
                      help="kernels are the stdlib primitives listed in docs/kernels.md, the file's `kernel` forms and those of `--kernels` modules")
        k = kernels[kname]
        if len(st.targets) != len(k.outputs):
            self.fail("S005", f"kernel `{kname}` produces {len(k.outputs)} value(s), {len(st.targets)} target(s) given",
                      st.span)
        args, attrs = self.lower_args(e, k, env, out, stream, op_id, rep, label, call_span, stdlib, op)
        self.emit(kname, args, tuple(outs), attrs, stream, out, op_id, rep, st.targets[0].id, label, st.span,
                  call_span, stdlib, into=into)

    def binop_call(self, e: A.Expr) -> A.Call:
        if isinstance(e, A.BinOp):
            if e.op == "*" and isinstance(e.left, A.Num):
                return A.Call(A.Name("scale", e.span), (e.right,), (A.KwArg(A.Name("alpha"), e.left),), e.span)
            if e.op in "*/" and isinstance(e.right, A.Num):
                v = e.right.value if e.op == "*" else 1.0 / e.right.value
                return A.Call(A.Name("scale", e.span), (e.left,), (A.KwArg(A.Name("alpha"), A.Num(v)),), e.span)
            if e.op == "/":
                self.fail("S015", "division by a buffer is not a kernel", e.span)
            name = {"+": "add", "-": "sub", "*": "mul"}[e.op]
            return A.Call(A.Name(name, e.span), (e.left, e.right), (), e.span)
        if isinstance(e, A.Neg):
            return A.Call(A.Name("scale", e.span), (e.operand,), (A.KwArg(A.Name("alpha"), A.Num(-1.0)),), e.span)
        if isinstance(e, A.Transpose):
            self.fail("S015", "`^T` transposes a matmul argument only", e.span)
        self.fail("S015", "a kernel call is expected here", e.span)

    def lower_args(self, e: A.Call, k, env, out, stream, op_id, rep, label, call_span, stdlib, op):
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
            args.append(self.lower_value(a, env, out, stream, op_id, rep, label, call_span, stdlib, op))
        op_attrs = env.get("__attrs__", {})
        for kw in e.kwargs:
            if kw.name.id not in k.attrs:
                self.fail("S015", f"kernel `{k.name}` has no attribute `{kw.name.id}`", kw.name.span,
                          help=f"attributes: {', '.join(k.attrs) or 'none'}")
            attrs[kw.name.id] = self.const(kw.value, op_attrs)
        return tuple(args), tuple(sorted(attrs.items()))

    def lower_value(self, a: A.Expr, env, out, stream, op_id, rep, label, call_span, stdlib, op) -> str:
        if isinstance(a, A.Var):
            if a.name.id not in env or a.name.id == "__attrs__":
                self.fail("S007", f"unknown buffer `{a.name.id}` in op `{op.name}`", a.name.span,
                          help="an op body reads its parameters and earlier statements' results")
            return env[a.name.id]
        call = a if isinstance(a, A.Call) else self.binop_call(a)
        kernels = self.kernels
        if call.func.id not in kernels and call.func.id in self.kernel_defs:
            raise _Abort()  # a `kernel` form whose mistakes were reported
        if call.func.id not in kernels:
            self.fail("S014", f"unknown kernel `{call.func.id}`", call.func.span,
                      help="kernels are the stdlib primitives listed in docs/kernels.md, the file's `kernel` forms and "
                           "those of `--kernels` modules")
        k = kernels[call.func.id]
        if len(k.outputs) != 1:
            self.fail("S015", f"kernel `{k.name}` produces several values and cannot be nested", call.span)
        args, attrs = self.lower_args(call, k, env, out, stream, op_id, rep, label, call_span, stdlib, op)
        self._tmp += 1
        tmp = f"{label.split(' ')[-1]}.t{self._tmp}"
        self.emit(k.name, args, (tmp,), attrs, stream, out, op_id, rep, "", label, call.span, call_span, stdlib)
        self.nested_values[id(a)] = tmp  # a derived backward reads it
        return tmp

    def emit(self, kname, args, outs, attrs, stream, out, op_id, rep, stmt, label, span, call_span, stdlib,
             into=None, kind="act") -> None:
        """Type-check one launch, create its output buffers, append its template."""
        k = self.kernels[kname]
        dup = next((o for i, o in enumerate(outs) if o in outs[:i]), None)
        if dup is not None:
            at = call_span if (stdlib and call_span is not None) else span
            self.fail("S002", f"two outputs of `{kname}` are the same buffer `{dup}`: one result would "
                      f"overwrite the other", at, help="pass a distinct buffer for each output")
        in_types = [self.btype(a) for a in args]
        all_attrs = {**k.attrs, **dict(attrs)}
        if not k.inputs and outs and self.has(outs[0]):
            shp, dt = self.btype(outs[0])
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
            self.fail(exc.code, exc.message if exc.message.startswith(kname) else f"{kname}: {exc.message}", at, labels=labels)
        for o, (shp, dt) in zip(outs, out_types):
            if self.has(o):
                have = self.btype(o)
                if have != (tuple(shp), dt):
                    code = "S004" if have[1] != dt else "S003"
                    at, labels = (call_span, [Label(span, "produced here")]) if stdlib and call_span else (span, [])
                    self.fail(code, f"`{o}` is {dt}{list(shp)} here but {have[1]}{list(have[0])} elsewhere", at,
                              labels=labels)
            else:
                for name in self.slotted(o):
                    self.add_buffer(name, shp, dt, "temp" if ".t" in o.rsplit(".", 1)[-1][:2] else kind, span)
        if into is not None:
            self.alias_into(outs, into, span, call_span if stdlib else None)
        # A task of a stdlib op points at the user's line that called the op.
        where = call_span if (stdlib and call_span is not None) else span
        out.append(TaskTemplate(kname, stream, tuple(args), tuple(outs), tuple(attrs), (), op_id, rep, stmt,
                                f"{label}.{stmt}" if stmt else label, where))

    def alias_into(self, outs, into: str, span: Span | None, call_span: Span | None = None) -> None:
        """Make every buffer of `outs` reuse the storage of `into` (its alias root), slot by slot:
        `x[a]`'s result lives in `x[a]`, `x[b]`'s in `x[b]` (LANGUAGE.md, `into`)."""
        at = call_span or span
        for o in outs:
            if SLOT in into and SLOT not in o:
                self.fail("S003", f"`into {_shown(into)}`: `{_shown(into)}` has one buffer per slot "
                          f"({', '.join(self.slots)}), but `{_shown(o)}` has one for all slots", at,
                          help=f"drop `into {_shown(into)}`")
            pairs = [(o.replace(SLOT, sl), into.replace(SLOT, sl)) for sl in self.slots] if SLOT in o else [(o, into)]
            for name, target in pairs:
                root_b = self.buffers[target]
                while root_b.alias_of:
                    root_b = self.buffers[root_b.alias_of]
                b = self.buffers[name]
                if b.name == root_b.name:
                    continue  # a value placed into itself
                if b.alias_of and b.alias_of != root_b.name:
                    self.fail("S015", f"`into {_shown(into)}`: `{_shown(o)}` already reuses the storage of "
                              f"`{_shown(b.alias_of)}`", at, help=f"drop `into {_shown(into)}`")
                if b.size * DTYPE_BYTES[b.dtype] > root_b.size * DTYPE_BYTES[root_b.dtype]:
                    self.fail("S003", f"`into {_shown(into)}`: `{_shown(o)}` does not fit in the storage of "
                              f"`{_shown(into)}`", at)
                self.buffers[name] = replace(b, alias_of=root_b.name)

    def storage_root(self, name: str) -> str:
        """The buffer whose storage a (template) name uses: the end of its `into` chain."""
        b = self.buffers.get(self.slotted(name)[0])
        seen = set()
        while b is not None and b.alias_of and b.alias_of not in seen:
            seen.add(b.alias_of)
            b = self.buffers.get(b.alias_of)
        return b.name.split("[")[0] if b is not None else name

    def _note_access(self, t: TaskTemplate, i: int, last_writer: dict, readers: dict) -> None:
        for r in map(self.storage_root, t.args):
            readers.setdefault(r, []).append(i)
        for r in map(self.storage_root, t.outs):
            last_writer[r] = i
            readers[r] = []

    def has(self, name: str) -> bool:
        return self.slotted(name)[0] in self.buffers

    # ------------------------------------------------------------------ models
    def expand_model(self, m: A.ModelDef, slot_inputs: bool) -> tuple[list[TaskTemplate], list[TaskTemplate], ModelInfo]:
        env: dict[str, Any] = {}
        for kw in m.params:
            env[kw.name.id] = self.const(kw.value, env)
        values: dict[str, str] = {}  # model value name -> buffer name
        producers: dict[str, list[int]] = {}  # model value name -> templates of the call making it
        evals: list[TaskTemplate] = []  # the forward as evaluation runs it (NAME.eval ops)
        poisoned: set[str] = set()
        self._poisoned = poisoned
        had_error = False
        inputs = []
        fwd: list[TaskTemplate] = []
        calls: list[_Call] = []
        params: list[str] = []
        for st in m.body:
            try:
                if isinstance(st, A.InputDecl):
                    shape, dtype = self.type_shape(st.type, env)
                    bname = f"{st.name.id}[{SLOT}]" if slot_inputs else st.name.id
                    if st.name.id in values:
                        self.fail("S002", f"`{st.name.id}` is defined twice in model `{m.name.id}`", st.name.span)
                    for n in self.slotted(bname):
                        self.add_buffer(n, shape, dtype, "input", st.span)
                    values[st.name.id] = bname
                    inputs.append((st.name.id, shape, dtype))
                    continue
                first = len(fwd)
                calls.append(self.model_call(m, st, env, values, fwd, len(calls), params))
                # `after` on model lines names model values: tasks answer to their value's name
                for i in range(first, len(fwd)):
                    site = replace(fwd[i].site or Site(), line=st.targets[0].id, line_tail=st.clauses.tail)
                    fwd[i] = replace(fwd[i], stmt=st.targets[0].id, site=site)
                self.eval_call(calls[-1], fwd[first:], evals)
                deps: list[int] = []
                for r in st.clauses.after:
                    if r.text in {t.id for t in st.targets}:
                        self.fail("S007", f"`after {r.text}`: this statement computes `{r.text}` itself", r.span,
                                  help="`after` names an earlier line of the model")
                    if r.text not in values:
                        later = any(isinstance(o, A.OpUse) and r.text in {t.id for t in o.targets} for o in m.body)
                        self.fail("S007", f"`after {r.text}`: " + (f"`{r.text}` is computed by a later line"
                                  if later else f"no value `{r.text}` in model `{m.name.id}`"), r.span,
                                  help="`after` names an earlier line of the model")
                    deps.extend(producers.get(r.text, []))
                for i in range(first, len(fwd)):
                    fwd[i] = replace(fwd[i], after=tuple(sorted(set(fwd[i].after) | set(deps))))
                for t in st.targets:
                    producers[t.id] = list(range(first, len(fwd)))
            except _Abort:
                had_error = True
                # Values this statement would have made are poisoned: later uses stay quiet
                # instead of repeating the one mistake as "unknown value".
                if isinstance(st, A.OpUse):
                    for t in st.targets:
                        values.pop(t.id, None)
                        poisoned.add(t.id)
                elif isinstance(st, A.InputDecl):
                    poisoned.add(st.name.id)
                continue
        if not calls or had_error:
            raise _Abort()
        last = calls[-1]
        loss = last.bind[last.outs[0]]
        shp, dt = self.btype(loss)
        if shp != () or dt not in ("f32", "f64", "f16", "bf16"):
            self.fail("S018", f"model `{m.name.id}` must end in a scalar loss; `{last.outs[0]}` is {dt}{list(shp)}",
                      last.span, help="end the model with a loss op such as softmax_cross_entropy")
        bwd = self.derive_backward(m, calls, loss, params)
        logits = last.bind.get(last.inputs[0], "") if last.inputs else ""
        labels = last.bind.get(last.inputs[1], "") if len(last.inputs) > 1 else ""
        label_input = next((k for k, v in values.items() if v == labels), "")
        batch = int(env.get("batch", inputs[0][1][0] if inputs else 1))
        info = ModelInfo(m.name.id, tuple(inputs), tuple(params), tuple(f"grad.{p}" for p in params), loss,
                         logits, label_input, batch, tuple(fwd), tuple(evals))
        return fwd, bwd, info

    def model_call(self, m, st: A.OpUse, env, values, fwd, op_id, params) -> _Call:
        name = st.call.func
        if name.id not in self.ops:
            self.fail("S006", f"unknown op `{name.id}`", name.span,
                      help=kernel_as_op_help(self, name.id) or "ops come from stdlib/ops.sched or an `op` block of this file")
        op = self.ops[name.id]
        ins, prm, grads, states, attrs = self.classify(op)
        if grads:
            self.fail("S015", f"`{op.name}` is an optimizer op; call it in a graph body on a model", name.span)
        # Free dimensions: named in param/output types but not in input types.
        in_dims = {d.name.id for p in ins if p.type for d in (p.type.dims or ()) if isinstance(d, A.Var)}
        free: list[str] = []
        for t in [p.type for p in prm + states] + [o.type for o in op.outs]:
            if t is None:
                continue
            for d in t.dims or ():
                if isinstance(d, A.Var) and d.name.id not in in_dims and d.name.id not in free:
                    free.append(d.name.id)
        slots_ = [p.name.id for p in ins] + free + [a.name.id for a in attrs]
        pos = list(st.call.args)
        if len(pos) > len(slots_) or len(pos) < len(ins):
            need = f"{len(ins)} input(s) ({', '.join(p.name.id for p in ins)})"
            if free:
                need += f" and the dimension(s) {', '.join(free)}"
            self.fail("S005", f"op `{op.name}` takes {need}; {len(pos)} argument(s) given", st.call.span,
                      labels=[Label(op.name_span, "defined here")] if op.name_span and op.name_span.file != STDLIB_PATH else [])
        given: dict[str, A.Expr] = dict(zip(slots_, pos))
        for kw in st.call.kwargs:
            if kw.name.id not in slots_:
                self.fail("S015", f"op `{op.name}` has no parameter `{kw.name.id}`", kw.name.span,
                          help=f"parameters: {', '.join(slots_)}")
            given[kw.name.id] = kw.value
        bind: dict[str, str] = {}
        dims: dict[str, Any] = {}
        for p in ins:
            a = given.get(p.name.id)
            if a is None:
                self.fail("S005", f"op `{op.name}` needs its input `{p.name.id}`", st.call.span)
            if not isinstance(a, A.Var):
                self.fail("S015", f"input `{p.name.id}` of `{op.name}` must name a value of the model", a.span)
            if a.name.id in self._poisoned:
                raise _Abort()
            if a.name.id not in values:
                self.fail("S007", f"unknown value `{a.name.id}` in model `{m.name.id}`", a.name.span,
                          help=("values so far: " + ", ".join(values)) if values else "declare it with `input`")
            bind[p.name.id] = values[a.name.id]
            if p.type is not None:
                self.unify(p.type, self.btype(values[a.name.id]), dims, f"`{a.name.id}`", a.span, p.span)
        for d in free:
            if d in given:
                v = self.const(given[d], env)
                if not isinstance(v, int) or v <= 0:
                    self.fail("S003", f"dimension `{d}` must be a positive integer, got {v!r}", given[d].span)
                dims[d] = v
            else:
                self.fail("S005", f"op `{op.name}` needs the dimension `{d}`", st.call.span)
        attr_vals = {a.name.id: self.const(a.default, {}) for a in attrs}
        for a in attrs:
            if a.name.id in given:
                attr_vals[a.name.id] = self.const(given[a.name.id], env)
        target0 = st.targets[0].id
        if "seed" in attr_vals and "seed" not in given:
            # An RNG key the line does not give is derived from the site, so that two same-shaped
            # dropout sites draw different masks (docs/language.md, "Random sites").
            from streamsched.stdlib.kernels.dropout import site_seed

            attr_vals["seed"] = site_seed(m.name.id, target0)
        for p in prm + states:
            # Parameters are trained; state (running statistics, RNG offsets) is created per use
            # the same way, checkpointed, and never differentiated.
            if p.type is None:
                self.fail("S015", f"`{p.name.id}` of op `{op.name}` needs a type", p.span)
            shape, dtype = self.type_shape(p.type, dims)
            init = "glorot" if p.modifier == "param" else "zeros"
            if isinstance(p.default, A.Var):
                init = p.default.name.id
                if init not in INITS:
                    self.fail("S015", f"unknown init `{init}`", p.default.span, help=f"inits: {', '.join(INITS)}")
            bname = f"{target0}.{p.name.id}"
            self.add_buffer(bname, shape, dtype, "param" if p.modifier == "param" else "state", p.span, init=init)
            if p.modifier == "param":
                params.append(bname)
            bind[p.name.id] = bname
        if not 1 <= len(st.targets) <= len(op.outs):
            self.fail("S005", f"op `{op.name}` produces {len(op.outs)} value(s); {len(st.targets)} target(s) given",
                      st.span)
        # `into V` on the model line: the line's results reuse the storage of the model value V.
        into = None
        if st.clauses.into is not None:
            iv = st.clauses.into.id
            if iv in self._poisoned:
                raise _Abort()
            if iv not in values:
                self.fail("S007", f"`into {iv}`: no value `{iv}` in model `{m.name.id}`", st.clauses.into.span,
                          help="`into` names an earlier value of the model whose storage this line's result reuses")
            into = values[iv]
        # Results an op body writes `into` a per-slot buffer (the model's input) exist per slot too.
        per_slot = {p.name.id for p in ins if SLOT in bind.get(p.name.id, "")}
        for kst in op.body:
            if kst.clauses.into is not None and kst.clauses.into.id in per_slot:
                per_slot.update(t.id for t in kst.targets)
        sfx = f"[{SLOT}]"
        # Outputs past the targets are kept for the backward (batch statistics, dropout masks).
        for o in op.outs[len(st.targets):]:
            bind[o.name.id] = f"{target0}.{o.name.id}" + (sfx if o.name.id in per_slot else "")
        for t, o in zip(st.targets, op.outs):
            if t.id in values:
                self.fail("S002", f"`{t.id}` is defined twice in model `{m.name.id}`", t.span)
            slotted = o.name.id in per_slot or (into is not None and SLOT in into)
            bname = t.id + (sfx if slotted else "")
            bind[o.name.id] = bname
            if o.type is not None:
                shape, dtype = self.type_shape(o.type, dims)
                for n in self.slotted(bname):
                    self.add_buffer(n, shape, dtype, "act", t.span)
            values[t.id] = bname
        attr_vals = {**dims, **attr_vals}  # dimension variables are constants in the body too
        env_op = dict(bind)
        env_op["__attrs__"] = attr_vals
        label = f"{op.name}@{target0}"
        on = self.stream(st.clauses.on, False) if st.clauses.on is not None else None
        first = len(fwd)
        self.nested_values = {}
        self.expand_op(op, env_op, attr_vals, fwd, op_id, target0, label, st.span, on=on)
        inner_env = {k: v for k, v in self.last_env.items() if k not in bind and k != "__attrs__"}
        inner_nodes = dict(self.nested_values)
        if into is not None:
            self.alias_into([bind[o.name.id] for o in op.outs[:len(st.targets)]], into, st.span)
            # The call's last task writing a result carries the clause (a fix drops it there).
            for i in reversed(range(first, len(fwd))):
                if set(fwd[i].outs) & {bind[o.name.id] for o in op.outs[:len(st.targets)]}:
                    site = fwd[i].site or Site()
                    fwd[i] = replace(fwd[i], site=replace(site, into_span=st.clauses.into_span))
                    break
        return _Call(op, bind, attr_vals, tuple(p.name.id for p in ins), tuple(p.name.id for p in prm),
                     tuple(o.name.id for o in op.outs), st.span, label, inner_env, inner_nodes)

    def eval_call(self, c: _Call, trained: list[TaskTemplate], out: list[TaskTemplate]) -> None:
        """Append the evaluation form of one forward call: `NAME.eval` bound by name (as a
        backward is: NAME's inputs, parameters, state and outputs), else the training form."""
        eop = self.ops.get(c.op.name + ".eval")
        if eop is None:
            out.extend(trained)
            return
        bind: dict[str, str] = {}
        for p in eop.params:
            if p.default is not None and p.type is None and p.modifier is None:
                continue
            if p.name.id not in c.bind:
                self.fail("S007", f"`{p.name.id}` of `{eop.name}` names nothing of `{c.op.name}`", p.span,
                          help=f"it may name {', '.join(c.bind)}")
            bind[p.name.id] = c.bind[p.name.id]
        for o in eop.outs:
            if o.name.id not in c.bind:
                self.fail("S007", f"output `{o.name.id}` of `{eop.name}` is not an output of `{c.op.name}`", o.span)
            bind[o.name.id] = c.bind[o.name.id]
        bind["__attrs__"] = c.attrs
        self.expand_op(eop, bind, c.attrs, out, -1, f"{c.label.split('@')[-1]}.eval", f"{eop.name}@{c.label.split('@')[-1]}",
                       c.span)

    def derive_backward(self, m, calls: list[_Call], loss: str, params: list[str]) -> list[TaskTemplate]:
        """Reverse-mode: gradients flow from d(loss) = 1 through each call's `.backward` op in
        reverse order; a value used by several calls gets one partial per use, summed."""
        needs: set[str] = set(params)
        for c in calls:
            if any(c.bind[n] in needs for n in c.inputs + c.params):
                needs.update(c.bind[o] for o in c.outs)
        uses: dict[str, int] = {}
        for c in calls:
            for n in c.inputs:
                if c.bind[n] in needs:
                    uses[c.bind[n]] = uses.get(c.bind[n], 0) + 1
        seed = SEED
        self.add_buffer(seed, (), self.btype(loss)[1], "const", init="ones")
        partials: dict[str, list[str]] = {loss: [seed]}
        bwd: list[TaskTemplate] = []
        op_id = len(calls)
        for c in reversed(calls):
            if not any(c.bind[n] in needs for n in c.inputs + c.params):
                continue
            outs_g = {o: partials.get(c.bind[o], []) for o in c.outs}
            if not any(outs_g.values()):
                continue
            bop = self.ops.get(c.op.name + ".backward")
            bind: dict[str, str] = {}
            if bop is None:  # derived from the body's kernels' gradient recipes (S012 when one has none)
                want = {x for x in c.inputs + c.params if c.bind[x] in needs}
                bop, bind = derive_op_backward(self, m, c, want, {o for o, ps in outs_g.items() if ps})
            for o, ps in outs_g.items():
                gname = grad_name(c.bind[o])
                if not ps:
                    continue
                if len(ps) == 1:
                    gname = ps[0]
                else:
                    stream = self.placed(bop.name, self.stream(bop.stream, bop.name in self.stdlib_ops), False)
                    acc = ps[0]
                    for i, p in enumerate(ps[1:]):
                        dst = gname if i == len(ps) - 2 else f"{gname}.sum{i}"
                        self.emit("accumulate", (acc, p), (dst,), (), stream, bwd, op_id, stream, "",
                                  f"sum@{c.bind[o]}", c.span, None, False, kind="grad")
                        acc = dst
                bind["d" + o] = gname
            produced = {od.name.id[1:] for od in bop.outs if od.name.id.startswith("d")}
            for x in c.inputs + c.params:
                if c.bind[x] in needs and x not in produced:
                    self.fail("S019", f"`{bop.name}` produces no `d{x}`, the gradient of `{x}`, which "
                              f"`{c.bind[x]}` needs to train what feeds it", c.span,
                              labels=[Label(bop.name_span, f"add an output `d{x}` here")] if bop.name_span else [])
            need_outs = set()
            out_bind: dict[str, str] = {}
            for od in bop.outs:
                x = od.name.id[1:] if od.name.id.startswith("d") else None
                if x is None or (x not in c.inputs and x not in c.params):
                    self.fail("S007", f"backward output `{od.name.id}` names no input of `{c.op.name}`", od.span,
                              help="outputs of NAME.backward are named d<input>")
                buf = c.bind[x]
                if buf not in needs:
                    continue
                if x in c.params:
                    target = f"grad.{buf}"
                else:
                    lst = partials.setdefault(buf, [])
                    target = grad_name(buf) if uses.get(buf, 1) == 1 else f"{grad_name(buf)}#{len(lst) + 1}"
                    lst.append(target)
                out_bind[od.name.id] = target
                need_outs.add(od.name.id)
            for p in bop.params:
                n = p.name.id
                if n in bind:
                    continue
                if n in c.bind:
                    bind[n] = c.bind[n]
                elif n.startswith("d") and n[1:] in c.outs:
                    self.fail("S007", f"`{n}`: no gradient reaches `{n[1:]}` of `{c.op.name}`", p.span)
                else:
                    self.fail("S007", f"backward parameter `{n}` names nothing of `{c.op.name}`", p.span,
                              help=f"it may name {', '.join(['d' + o for o in c.outs] + list(c.bind))}")
            env = {**bind, **out_bind, "__attrs__": c.attrs}
            for od_name, target in out_bind.items():
                if target.startswith("grad."):
                    kind = "grad"
                    shp, dt = self.btype(target[5:])
                    self.add_buffer(target, shp, dt, kind)
            self.expand_op(bop, env, c.attrs, bwd, op_id, f"{c.label.split('@')[-1]}.bwd",
                           f"{bop.name}@{c.label.split('@')[-1]}", c.span, need=need_outs)
            op_id += 1
        for c in calls:
            for pn in c.params:
                if f"grad.{c.bind[pn]}" not in self.buffers:
                    self.fail("S020", f"parameter `{c.bind[pn]}` gets no gradient: `{c.outs and c.bind[c.outs[0]]}` "
                              f"does not reach the loss", c.span,
                              help="use its result on the way to the loss, or remove the line")
        return bwd

    # ------------------------------------------------------------------ graphs
    def expand_graph(self, g: A.GraphDef, fwd, bwd, model_name: str, op_base: int) -> GraphInfo:
        home = self.stream(g.stream, stdlib=False)
        out: list[TaskTemplate] = []
        slotted_graph = bool(g.slots)
        op_id = op_base
        spans_of: list[tuple[str, int, int]] = []  # (statement name, first template, end) per statement
        pending_after: list[tuple[int, int, A.CallStmt]] = []
        for gi, st in enumerate(g.body):
            start = len(out)
            try:
                if isinstance(st, A.CopyStmt):
                    if st.source.id != "batch":
                        self.fail("S007", f"unknown data source `{st.source.id}`", st.source.span,
                                  help="`copy batch -> x, y` copies the next batch of the train block's data")
                    for t in st.targets:
                        b = t.id + (f"[{SLOT}]" if slotted_graph else "")
                        if not self.has(b):
                            if self.broken_models:
                                raise _Abort()
                            self.fail("S007", f"`{t.id}` is not an input of the model", t.span)
                        hb = f"{t.id}@host" + (f"[{SLOT}]" if slotted_graph else "")
                        shp, dt = self.btype(b)
                        for n in self.slotted(hb):
                            self.add_buffer(n, shp, dt, "staging", t.span, space="host")
                        out.append(TaskTemplate("stage", HOST, (), (hb,), (("field", t.id),), (), op_id, HOST,
                                                f"stage.{t.id}", f"{g.name.id}: stage {t.id}", t.span))
                        out.append(TaskTemplate("h2d", home, (hb,), (b,), (), (), op_id, home, t.id,
                                                f"{g.name.id}: copy {t.id}", t.span))
                    op_id += 1
                elif isinstance(st, (A.ForwardStmt, A.BackwardStmt)):
                    self.model_ref(st.model, model_name)
                    self.runs[type(st).__name__] = st.span
                    self.graph_runs.setdefault(g.name.id, {}).setdefault(type(st).__name__, st.span)
                    src = fwd if isinstance(st, A.ForwardStmt) else bwd
                    if isinstance(st, A.BackwardStmt) and st.scale is not None:
                        src = self.scaled_backward(st, bwd)
                    base = len(out)
                    derived = isinstance(st, A.BackwardStmt)
                    # The backward is derived, so nobody can write its `after` clauses: its hazards
                    # against earlier work of the graph (RAW, and the WAR/WAW an `into` in a backward
                    # op makes) are ordered for the user under every policy, by storage.
                    last_writer: dict[str, int] = {}
                    readers: dict[str, list[int]] = {}
                    for i, t in enumerate(out):
                        self._note_access(t, i, last_writer, readers)
                    for t in src:
                        after = tuple(a + base for a in t.after)
                        if derived:
                            need = {last_writer[r] for r in map(self.storage_root, t.args) if r in last_writer}
                            for r in map(self.storage_root, t.outs):
                                need |= set(readers.get(r, ())) | ({last_writer[r]} if r in last_writer else set())
                            after = tuple(sorted(set(after) | need))
                        site = replace(t.site or Site(), derived=derived)
                        out.append(replace(t, op=t.op + op_base + 1000 * (1 + derived), after=after,
                                           label=f"{g.name.id}: {t.label}", site=site))
                        self._note_access(out[-1], len(out) - 1, last_writer, readers)
                elif isinstance(st, A.ClearStmt):
                    for buf in self.graph_call_targets(st.call, model_name):
                        op = self.ops["clear"]
                        first = len(out)
                        self.expand_op(op, {"x": buf, "__attrs__": {}}, {}, out, op_id, f"clear.{buf}",
                                       f"{g.name.id}: clear@{buf}", st.span)
                        for i in range(first, len(out)):
                            out[i] = replace(out[i], label=f"{g.name.id}: clear {buf}")
                        op_id += 1
                elif isinstance(st, A.UploadStmt):
                    stream = self.stream(st.stream, False) if st.stream else home
                    self.upload(st.name, stream, out, op_id, g.name.id, per_slot=bool(g.slots))
                    op_id += 1
                elif isinstance(st, A.SyncStmt):
                    out.append(TaskTemplate("synchronize", home, (), (), (), (), op_id, home, "synchronize",
                                            f"{g.name.id}: synchronize", st.span))
                    op_id += 1
                elif isinstance(st, A.AllocStmt):
                    shape, dtype = self.type_shape(st.type, {})
                    self.add_buffer(st.name.id, shape, dtype, "temp", st.span)
                    out.append(TaskTemplate("alloc", home, (), (st.name.id,), (("shape", shape), ("dtype", dtype)), (),
                                            op_id, home, st.name.id, f"{g.name.id}: alloc {st.name.id}", st.span))
                    op_id += 1
                elif isinstance(st, A.CallStmt):
                    if st.clauses.into is not None:
                        self.fail("S015", f"`into` on a graph statement: `{st.call.func.id}` writes the buffers it is "
                                  "given", st.clauses.into_span or st.clauses.into.span,
                                  help=f"drop `into {st.clauses.into.id}`; `into` belongs to a statement of an op body "
                                       "or a model line")
                    op_id = self.graph_op_call(g, st, out, op_id, model_name)
                    if st.clauses.after:
                        pending_after.append((start, len(out), st))
            except _Abort:
                continue
            finally:
                gname = _graph_stmt_name(st)
                gtail = st.clauses.tail if isinstance(st, A.CallStmt) else None
                gafters = st.clauses.after_clauses if isinstance(st, A.CallStmt) else ()
                for i in range(start, len(out)):
                    out[i] = replace(out[i], site=replace(out[i].site or Site(), gstmt=gi, gname=gname, gtail=gtail,
                                                          g_afters=gafters))
                spans_of.append((gname, start, len(out)))
        # `after NAME` on a graph statement: its tasks follow the last task on each stream of the
        # latest earlier statement called NAME (a later one closes a cycle: R002 reports it).
        for start, end, st in pending_after:
            for r in st.clauses.after:
                pos = next((i for i, (nm, a, b) in enumerate(spans_of) if a == start and b == end), len(spans_of))
                named = [sp for sp in spans_of[:pos] if sp[0] == r.text][-1:]
                later = [i for i in range(pos, len(spans_of)) if spans_of[i][0] == r.text]
                if not named and later:
                    here = f"`{_graph_stmt_name(st)}(...)` ({_at(st.span)})"
                    there = g.body[later[0]]
                    self.err("R002", f"dependency cycle: {here} -[after]-> `{r.text}` ({_at(there.span)}) -[issued "
                             f"first]-> {here}" if later[0] != pos else f"dependency cycle: {here} is ordered after "
                             "itself", r.span,
                             labels=[Label(there.span, "issued here, later in the graph")] if later[0] != pos else [],
                             help=f"`after {r.text}` names a statement the graph issues later; move this statement "
                                  f"below it, or drop the clause", fixes=drop_ref(st.clauses.after_clauses, r.text))
                    continue
                if not named:
                    names = sorted({nm for nm, _, _ in spans_of[:pos]})
                    self.err("S007", f"`after {r.text}`: no statement `{r.text}` in graph `{g.name.id}` before this one",
                             r.span, help="`after` in a graph names an earlier statement of the graph: "
                                          + (", ".join(f"`{n}`" for n in names) if names else "there is none"))
                    continue
                _, a, b = named[0]
                sinks: dict[str, int] = {}
                for i in range(a, b):
                    sinks[out[i].stream] = i
                for i in range(start, end):
                    out[i] = replace(out[i], after=tuple(sorted(set(out[i].after) | set(sinks.values()))))
        slotted = any(SLOT in n for t in out for n in t.args + t.outs)
        return GraphInfo(g.name.id, home, tuple(s.id for s in g.slots), tuple(out), slotted, g.span)

    def declare_states(self) -> None:
        """`state { NAME : TYPE = INIT }`: device buffers outside every model (the loss
        scale, an overflow flag), initialized once, checkpointed.  A declaration that fails is
        remembered, so its uses stay quiet instead of repeating the mistake as S007."""
        for name, d in self.state_decls.items():
            try:
                taken = name in self.buffers or any(f"{name}[{s}]" in self.buffers for s in self.slots)
                if taken or name in KNOWN_HOST_VALUES:
                    what = "a host value" if name in KNOWN_HOST_VALUES else "already a buffer of the model"
                    self.fail("S002", f"`state {name}`: `{name}` is {what}", d.name.span,
                              help="give the state another name")
                if name.startswith("__"):
                    self.fail("S015", f"`state {name}`: names starting with `__` are reserved", d.name.span)
                shape, dtype = self.type_shape(d.type, {})
                init = "zeros"
                if isinstance(d.init, A.Var) and d.init.name.id in ("zeros", "ones"):
                    init = d.init.name.id
                elif isinstance(d.init, A.Var) and d.init.name.id in INITS:
                    self.fail("S015", f"`state {name}` starts as a number, `zeros` or `ones`; "
                              f"`{d.init.name.id}` initializes weights", d.init.span)
                elif d.init is not None:
                    v = self.const(d.init, {})
                    if isinstance(v, bool) or not isinstance(v, (int, float)):
                        shown = ("true" if v else "false") if isinstance(v, bool) else \
                            (f'"{v}"' if isinstance(v, str) else str(v))
                        self.fail("S015", f"`state {name}` starts as a number, `zeros` or `ones`, not {shown}",
                                  d.init.span)
                    if dtype not in FLOAT_DTYPES and float(v) != int(v):
                        self.fail("S004", f"`state {name}` is {dtype}, but its initial value {v} is not an "
                                  f"integer", d.init.span)
                    lo, hi = _DTYPE_RANGE.get(dtype, (None, None))
                    if hi is not None and not lo <= v <= hi:
                        self.fail("S004", f"`state {name}` is {dtype}, which cannot hold {v} (range {lo:g} to "
                                  f"{hi:g})", d.init.span)
                    init = f"const:{v!r}"
                self.add_buffer(name, shape, dtype, "state", d.span, init=init)
            except _Abort:
                self.broken_states.add(name)
                continue

    def model_ref(self, m: A.Name, model_name: str) -> None:
        """A graph names the trained model; stay quiet when that model already failed (its own
        diagnostics say why) instead of repeating the mistake as "unknown model"."""
        if m.id == model_name:
            return
        if m.id in self.broken_models:
            raise _Abort()
        if m.id in self.models:
            self.fail("S013", f"model `{m.id}` is not the one this file trains (`{model_name}`)", m.span,
                      help="the `train` block's `model` says which model the graphs run")
        self.fail("S013", f"unknown model `{m.id}`", m.span, help=f"models: {', '.join(self.models) or 'none'}")

    def scaled_backward(self, st: A.BackwardStmt, bwd: list[TaskTemplate]) -> list[TaskTemplate]:
        """`backward M * S`: the backward with its gradient seed d(loss) read from the device
        scalar S (dynamic loss scaling: every gradient comes out multiplied by S) instead of 1."""
        sname = st.scale
        if sname.id in self.broken_states:
            raise _Abort()
        b = self.buffers.get(sname.id)
        if b is None or b.kind != "state":
            if sname.id in KNOWN_HOST_VALUES or (b is not None and b.kind == "scalar"):
                why, help_ = (f"`{sname.id}` is a host value, not a loss scale",
                              "the loss scale is a `state { }` buffer: `state { loss_scale : f32[] = 65536 }`")
            elif b is not None or any(f"{sname.id}[{s}]" in self.buffers for s in self.slots):
                why, help_ = (f"`{sname.id}` is a value of the model, not a loss scale",
                              "the loss scale is a `state { }` buffer: `state { loss_scale : f32[] = 65536 }`")
            else:
                why, help_ = (f"no device scalar `{sname.id}`",
                              f"declare it at the top level: `state {{ {sname.id} : f32[] = 65536 }}`")
            self.fail("S007", f"`backward {st.model.id} * {sname.id}`: {why}", sname.span, help=help_)
        have = self.btype(sname.id)
        seed = self.btype(SEED)
        if have[0] != ():
            self.fail("S003", f"the loss scale `{sname.id}` must be a scalar (shape []), not {list(have[0])}",
                      sname.span)
        if have[1] not in FLOAT_DTYPES:
            self.fail("S004", f"the loss scale `{sname.id}` is {have[1]}; it must be a float dtype (the loss is "
                      f"{seed[1]})", sname.span)
        init = self.inits.get(sname.id, "zeros")
        start = float(init[6:]) if init.startswith("const:") else (1.0 if init == "ones" else 0.0)
        if not start > 0:
            decl = self.state_decls.get(sname.id)
            self.fail("S015", f"the loss scale `{sname.id}` starts at {start:g}; it must be positive", sname.span,
                      labels=[Label(decl.span, "declared here")] if decl is not None else [],
                      help="start it at a power of two, as GradScaler does: 65536")
        self.loss_scale = sname.id
        return [replace(t, args=tuple(sname.id if a == SEED else a for a in t.args)) for t in bwd]

    def graph_call_targets(self, call: A.Call | A.Name, model_name: str) -> list[str]:
        if isinstance(call, A.Name):
            if call.id in self.broken_states:
                raise _Abort()
            b = self.buffers.get(call.id)
            help_ = ("`clear grad(MODEL)` zeroes a model's gradients; `clear NAME` one buffer of a `state { }` "
                     "block (an overflow flag, a counter)")
            if b is None:
                self.fail("S007", f"`clear {call.id}`: no `state` buffer `{call.id}`", call.span, help=help_)
            if b.kind != "state" or b.name not in self.state_decls:
                self.fail("S015", f"`clear {call.id}`: `{call.id}` is not a `state` buffer: clearing it would "
                          "overwrite what the step computes or loads", call.span, help=help_)
            return [call.id]
        if call.func.id != "grad" or len(call.args) != 1 or not isinstance(call.args[0], A.Var):
            self.fail("S015", "`clear` takes `grad(MODEL)`", call.span)
        self.model_ref(call.args[0].name, model_name)
        return list(self.model_info.grads) if self.model_info else []

    def host_value(self, name: A.Name) -> None:
        if name.id not in KNOWN_HOST_VALUES:
            self.fail("S007", f"unknown host value `{name.id}`", name.span,
                      help="the training loop uploads `lr` (the scheduled learning rate) and `step` (the step count, from 1)")

    def upload(self, name: A.Name, stream: str, out, op_id, where: str, per_slot: bool = True) -> None:
        """An `upload` statement of a graph body.  per_slot: the graph has slots, so its pinned
        staging buffer exists once per slot; a graph without slots gets one (the host waits for
        the copy that last read it), so the upload does not make the graph need a slot (S017)."""
        self.host_value(name)
        hb = f"{name.id}@host" + (f"[{SLOT}]" if self.slots and per_slot else "")
        for n in self.slotted(hb):
            self.add_buffer(n, (), "f32", "staging", name.span, space="host")
        self.add_buffer(name.id, (), "f32", "scalar", name.span)
        self.uploads.add(name.id)
        out.append(TaskTemplate("set_scalar", HOST, (), (hb,), (("name", name.id),), (), op_id, HOST,
                                f"set.{name.id}", f"{where}: set {name.id}", name.span))
        out.append(TaskTemplate("h2d", stream, (hb,), (name.id,), (), (), op_id, stream, f"upload.{name.id}",
                                f"{where}: upload {name.id}", name.span))

    def device_scalar(self, v: A.Var) -> str:
        n = v.name.id
        if n in self.broken_states:
            raise _Abort()
        if n in self.buffers and self.buffers[n].kind != "scalar":
            return n
        if n in self.uploads_planned:
            self.add_buffer(n, (), "f32", "scalar", v.span)
            return n
        if n in KNOWN_HOST_VALUES:
            where = "to the step" if self.steps else "to a `step` block (the file has none yet)"
            self.fail("C002", f"host value `{n}` is read inside a captured graph, but never uploaded to the device",
                      v.span, help=f"add `upload {n} on trans` {where}: step-varying values live in device buffers")
        self.fail("S007", f"unknown buffer or value `{n}`", v.span)
        return n

    def graph_op_call(self, g: A.GraphDef, st: A.CallStmt, out, op_id: int, model_name: str) -> int:
        name = st.call.func
        if name.id not in self.ops:
            self.fail("S006", f"unknown op `{name.id}`", name.span,
                      help=kernel_as_op_help(self, name.id) or "ops: " + ", ".join(sorted(self.ops)))
        op = self.ops[name.id]
        ins, prm, grads, states, attrs = self.classify(op)
        args = list(st.call.args)
        per_param = bool(prm or grads)
        if per_param:
            self.runs.setdefault("optimizer", st.span)
            self.graph_runs.setdefault(g.name.id, {}).setdefault("optimizer", st.span)
            if args and isinstance(args[0], A.Var):
                self.model_ref(args[0].name, model_name)
            if not args or not isinstance(args[0], A.Var) or args[0].name.id != model_name:
                self.fail("S015", f"`{op.name}` updates a model's parameters: its first argument is the model",
                          st.call.span)
            args = args[1:]
        # inputs may also be given by name (`sgd_amp(m, lr, scale = loss_scale, found_inf = f)`)
        in_names = [p.name.id for p in ins]
        kwargs = []
        by_name: dict[str, A.Expr] = {}
        for kw in st.call.kwargs:
            if kw.name.id in in_names:
                if kw.name.id in by_name or in_names.index(kw.name.id) < len(args):
                    self.fail("S002", f"input `{kw.name.id}` of `{op.name}` is given twice", kw.name.span)
                by_name[kw.name.id] = kw.value
            else:
                kwargs.append(kw)
        if len(args) > len(ins) or len(args) + len(by_name) != len(ins):
            missing = [n for n in in_names[len(args):] if n not in by_name]
            self.fail("S005", f"op `{op.name}` takes {len(ins) + per_param} argument(s) "
                      f"({'model, ' if per_param else ''}{', '.join(in_names)}); "
                      f"{len(args) + len(by_name) + per_param} given"
                      + (f" (missing: {', '.join(missing)})" if missing and len(args) <= len(ins) else ""),
                      st.call.span)
        args = args + [by_name[n] for n in in_names[len(args):]]
        attr_vals = {a.name.id: self.const(a.default, {}) for a in attrs}
        layers: list[str] | None = None
        for kw in kwargs:
            if per_param and kw.name.id == "layers":
                # `layers = "c1 c2"`: update only these layers' parameters (the seed's LARS split
                # by layer group over three streams)
                v = self.const(kw.value, {})
                if not isinstance(v, str) or not v.split():
                    self.fail("S015", "`layers` is a string of layer names: `layers = \"c1 c2\"`", kw.value.span)
                layers = v.split()
                known = {p.rsplit(".", 1)[0] for p in (self.model_info.params if self.model_info else ())}
                for lay in layers:
                    if lay not in known:
                        self.fail("S007", f"`{lay}` is not a layer with parameters", kw.value.span,
                                  help=f"layers: {', '.join(sorted(known))}")
                continue
            if kw.name.id not in attr_vals:
                self.fail("S015", f"op `{op.name}` has no attribute `{kw.name.id}`", kw.name.span,
                          help=f"attributes: {', '.join(attr_vals) or 'none'}")
            attr_vals[kw.name.id] = self.const(kw.value, {})
        on = self.stream(st.clauses.on, False) if st.clauses.on is not None else None
        base: dict[str, str] = {}
        dims: dict[str, Any] = {}  # dimension and dtype variables, shared by all the arguments
        for p, a in zip(ins, args):
            if not isinstance(a, A.Var):
                self.fail("S015", f"argument `{p.name.id}` of `{op.name}` must name a buffer", a.span)
            buf = self.device_scalar(a)
            if p.type is not None:
                self.unify(p.type, self.btype(buf), dims, f"`{a.name.id}`", a.span, p.span)
            base[p.name.id] = buf
        # Per-parameter updates are issued in reverse layer order: the order in which the backward
        # finishes their gradients, so one stream's queue never waits on the last gradient first.
        params = list(reversed(self.model_info.params)) if (per_param and self.model_info) else [None]
        if layers is not None:
            params = [p for p in params if p.rsplit(".", 1)[0] in layers]
        for pbuf in params:
            bind = dict(base)
            if pbuf is not None:
                shp, dt = self.btype(pbuf)
                if prm:
                    bind[prm[0].name.id] = pbuf
                for gp in grads:
                    bind[gp.name.id] = f"grad.{pbuf}"
                for sp in states:
                    sname = f"{op.name}.{sp.name.id}.{pbuf}"
                    init = "zeros"
                    if isinstance(sp.default, A.Var) and sp.default.name.id == "copy":
                        init = f"copy:{pbuf}"  # starts as a copy of the parameter (an EMA, a master copy)
                    # `state master : f32`: the parameter's shape in its own dtype (f32 master
                    # weights of an f16 model)
                    sdt = self.type_dtype(sp.type, {}) if sp.type is not None and sp.type.dims is None else dt
                    self.add_buffer(sname, shp, sdt, "state", sp.span, init=init)
                    bind[sp.name.id] = sname
            bind["__attrs__"] = attr_vals
            tag = pbuf or op.name
            self.expand_op(op, bind, attr_vals, out, op_id, f"{op.name}.{tag}", f"{g.name.id}: {op.name}@{tag}",
                           st.span, on=on)
            op_id += 1
        return op_id

    # ------------------------------------------------------------------ step, train
    def resolve_step(self, graphs: dict[str, GraphInfo]) -> tuple[Launch, ...]:
        if not self.steps:
            return ()
        s = self.steps[0]
        slot_param = s.param.id if s.param else ""
        out = []
        launched = {".".join(p.id for p in st.ref.parts) for st in s.body if isinstance(st, A.LaunchStmt)}
        launched |= {f"upload.{st.name.id}" for st in s.body if isinstance(st, A.UploadStmt)}
        for st in s.body:
            try:
                clauses = getattr(st, "clauses", None)
                after = tuple(self.after_ref(r, graphs) for r in clauses.after) if clauses else ()
                for r, ar in zip(clauses.after if clauses else (), after):
                    if ar.graph not in launched:
                        what = (f"the step does not upload `{ar.graph[7:]}` (a graph does: order after that graph)"
                                if ar.graph.startswith("upload.") else f"the step never launches `{ar.graph}`")
                        self.fail("S008", f"`after {r.text}`: {what}", r.span,
                                  help="`after` in the step names another statement of the step: "
                                       + ", ".join(f"`{n}`" for n in sorted(launched)))
                if clauses is not None and isinstance(st, A.UploadStmt) and clauses.into is not None:
                    self.fail("S015", f"`into` on an upload: `upload {st.name.id}` writes the device scalar "
                              f"`{st.name.id}`", clauses.into_span or clauses.into.span,
                              help=f"drop `into {clauses.into.id}`")
                if clauses is not None and isinstance(st, A.LaunchStmt) and (clauses.on or clauses.into):
                    bad = clauses.on or clauses.into
                    kw = "on" if clauses.on else "into"
                    self.fail("S015", f"`{kw}` on a launch: graph `{st.ref.text}` runs on its home stream and writes "
                              "its own buffers", bad.span,
                              help=f"drop `{kw} {bad.id}`; a graph's home stream is set where it is defined "
                                   "(`graph NAME on STREAM`), a kernel's with `on` in an op body")
                if isinstance(st, A.UploadStmt):
                    self.host_value(st.name)
                    stream = self.stream(st.stream, False) if st.stream else self.fold("trans")
                    hb = f"{st.name.id}@host" + (f"[{SLOT}]" if self.slots else "")
                    for n in self.slotted(hb):
                        self.add_buffer(n, (), "f32", "staging", st.name.span, space="host")
                    self.add_buffer(st.name.id, (), "f32", "scalar", st.name.span)
                    self.uploads.add(st.name.id)
                    out.append(Launch("upload", name=st.name.id, stream=stream, after=after, span=st.span,
                                      tail=st.clauses.tail, ref=f"upload.{st.name.id}",
                                      after_clauses=st.clauses.after_clauses,
                                      text=f"upload {st.name.id}" + (f" on {st.stream.id}" if st.stream else "")))
                elif isinstance(st, A.SyncStmt):
                    out.append(Launch("sync", span=st.span, ref="synchronize"))
                else:
                    ln = self.launch(st, graphs, slot_param, after)
                    text = st.ref.text + (f"({', '.join(b.text for b in st.binds)})" if st.binds is not None else "")
                    out.append(replace(ln, tail=st.clauses.tail, ref=ln.graph, after_clauses=st.clauses.after_clauses,
                                       text=text))
            except _Abort:
                continue
        return tuple(out)

    def after_ref(self, r: A.Ref, graphs) -> AfterRef:
        parts = [p.id for p in r.parts]
        prev = False
        if len(parts) >= 2 and parts[0] == "prev":
            prev, parts = True, parts[1:]
        if len(parts) == 2 and parts[0] == "upload":
            if parts[1] not in self.uploads_planned:
                self.fail("S007", f"`after {r.text}`: the step does not upload `{parts[1]}`", r.span)
            return AfterRef(f"upload.{parts[1]}", prev, r.span)
        if len(parts) != 1 or parts[0] not in graphs:
            self.fail("S008", f"unknown graph `{r.text}` in `after`", r.span,
                      help=f"graphs: {', '.join(graphs)}; `prev.NAME` names the previous step's launch; "
                           "`upload.NAME` an upload")
        return AfterRef(parts[0], prev, r.span)

    def slot_of(self, idx: A.Name, slot_param: str) -> str:
        if idx.id == slot_param:
            return "slot"
        if idx.id == "next":
            return "next"
        if idx.id in self.slots:
            return idx.id
        self.fail("S009", f"unknown slot `{idx.id}`", idx.span,
                  help=f"use `{slot_param or 'slot'}` (this step's slot), `next`, or one of {', '.join(self.slots) or 'no slots'}")
        return ""

    def launch(self, st: A.LaunchStmt, graphs, slot_param: str, after) -> Launch:
        r = st.ref
        gname = ".".join(p.id for p in r.parts)
        if gname not in graphs:
            self.fail("S008", f"unknown graph `{gname}`", r.span, help=f"graphs: {', '.join(graphs) or 'none'}")
        g = graphs[gname]
        slot = ""
        if r.index is not None:
            if not g.slots:
                self.fail("S009", f"graph `{gname}` has no slots", r.index.span,
                          help=f"declare them: `graph {gname}[a, b] on ...`")
            slot = self.slot_of(r.index, slot_param)
        for b in st.binds or ():
            bg = ".".join(p.id for p in b.parts)
            if bg not in graphs:
                self.fail("S008", f"unknown graph `{bg}`", b.span)
            if b.index is None:
                if not graphs[bg].slots:
                    self.fail("S009", f"graph `{bg}` has no slots to bind", b.span,
                              help=f"a launch binds a slotted graph's slot, e.g. `{gname}(load[{slot_param or 'slot'}])`")
                self.fail("S009", f"`{bg}` needs a slot here: `{bg}[{slot_param or 'slot'}]`", b.span)
            if not graphs[bg].slots:
                self.fail("S009", f"graph `{bg}` has no slots", b.index.span)
            slot = self.slot_of(b.index, slot_param)
        if g.slotted and not slot:
            sp = slot_param or "slot"
            # Only forms valid here: `G[slot]` needs G to declare slots; a binding names a slotted graph.
            binder = next((n for n, gi in graphs.items() if gi.slots and n != gname), "load")
            forms = [f"`{gname}({binder}[{sp}])`"] + ([f"`{gname}[{sp}]`"] if g.slots else [])
            self.fail("S017", f"graph `{gname}` uses per-slot buffers; say which slot it runs on",
                      r.span, help=f"write {' or '.join(forms)}")
        binds = tuple(".".join(p.id for p in b.parts) for b in st.binds or ())
        return Launch("graph", graph=gname, slot=slot, after=after, binds=binds, span=st.span)

    def train_items(self) -> tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, Span | None], ...]]:
        if self.train is None:
            return (), ()
        vals, spans = [], []
        seen: dict[str, Span | None] = {}
        for it in self.train.items:
            k = it.key.id
            if k not in TRAIN_KEYS:
                self.err("S015", f"unknown train setting `{k}`", it.key.span, help=f"settings: {', '.join(TRAIN_KEYS)}")
                continue
            if k in seen:
                self.err("S002", f"train setting `{k}` is given twice", it.key.span,
                         labels=[Label(seen[k], "first given here")])
                continue
            seen[k] = it.span
            try:
                vals.append((k, self.train_value(it.value)))
                spans.append((k, it.value.span))
            except _Abort:
                continue
        return tuple(vals), tuple(spans)

    def train_value(self, e: A.Expr) -> Any:
        if isinstance(e, A.Call):
            args = tuple(self.train_value(a) for a in e.args)
            kws = tuple((k.name.id, self.train_value(k.value)) for k in e.kwargs)
            return CallValue(e.func.id, args, kws, e.span)
        if isinstance(e, A.Var):
            return e.name.id
        return self.const(e, {})

    # ------------------------------------------------------------------ driver
    def run(self, path: str, policy: str | None, capture: str | None) -> Program:
        self.collect()
        self.kernels.update(compile_kernel_defs(self, list(self.kernel_defs.values()), _kernels(), self.kernel_origins))
        check_ops(self)
        self.check_places()
        train_vals, train_spans = self.train_items()
        tv = dict(train_vals)
        # The trained model: the train block's `model`, else the only one.
        model_ast = None
        if "model" in tv:
            if not isinstance(tv["model"], str):
                self.err("S015", "`model` names a model: `model = NAME`", dict(train_spans).get("model"),
                         help="model parameters are set in the model's header: `model mlp(hidden = 32)`")
                self.broken_models |= set(self.models)
            elif tv["model"] not in self.models:
                self.err("S013", f"unknown model `{tv['model']}`", dict(train_spans).get("model"),
                         help=f"models: {', '.join(self.models) or 'none'}")
                self.broken_models |= set(self.models) | {tv["model"]}
            else:
                model_ast = self.models[tv["model"]]
        elif self.models:
            model_ast = next(iter(self.models.values()))
        # Slots come from the slotted graph that copies the batch.
        for g in self.graphs_ast.values():
            if g.slots:
                names = tuple(s.id for s in g.slots)
                if len(set(names)) != len(names):
                    self.err("S002", f"graph `{g.name.id}` names a slot twice", g.span)
                elif self.slots and names != self.slots:
                    self.err("S009", f"graph `{g.name.id}` has slots {list(names)}, others have {list(self.slots)}",
                             g.span)
                else:
                    self.slots = names
        copies_inputs = any(isinstance(s, A.CopyStmt) and g.slots for g in self.graphs_ast.values() for s in g.body)
        # Planned uploads (a graph may read `lr` only if the step or a graph uploads it).
        self.uploads_planned = {st.name.id for s in self.steps for st in s.body if isinstance(st, A.UploadStmt)}
        self.uploads_planned |= {st.name.id for g in self.graphs_ast.values() for st in g.body
                                 if isinstance(st, A.UploadStmt)}
        fwd: list[TaskTemplate] = []
        bwd: list[TaskTemplate] = []
        if model_ast is not None:
            try:
                fwd, bwd, self.model_info = self.expand_model(model_ast, copies_inputs and bool(self.slots))
            except _Abort:
                self.broken_models.add(model_ast.name.id)
        self.declare_states()
        # Check every op body where it is defined, used or not (LANGUAGE.md, "Barrier policies").
        graphs: dict[str, GraphInfo] = {}
        for i, g in enumerate(self.graphs_ast.values()):
            try:
                graphs[g.name.id] = self.expand_graph(g, fwd, bwd, self.model_info.name if self.model_info else "",
                                                      10000 * (i + 1))
            except _Abort:
                continue
        before = len(self.diags)
        step = self.resolve_step(graphs)
        if self.model_info is not None:
            # What the launched graphs run (every graph, in a file without a step, or whose step
            # has mistakes of its own: those are reported, not followed up)
            exact = self.steps and len(self.diags) == before
            launched = {ln.graph for ln in step if ln.kind == "graph"} if exact else set(self.graph_runs)
            runs: dict[str, Span | None] = {}
            for gname, kinds in self.graph_runs.items():
                if gname in launched:
                    for kind, span in kinds.items():
                        runs.setdefault(kind, span)
            m = self.model_info.name
            unlaunched = " (the graph that does is never launched by the step)"
            if "optimizer" in runs and "BackwardStmt" not in runs:
                why = unlaunched if "BackwardStmt" in self.runs else ""
                self.err("S021", f"the optimizer updates `{m}`, but no graph runs `backward {m}`{why}: "
                         "its gradients are never computed", runs["optimizer"],
                         help=("launch that graph in the step" if why else
                               f"add `backward {m}` after `forward {m}` in the graph that runs the model"))
            if "BackwardStmt" in runs and "ForwardStmt" not in runs:
                why = unlaunched if "ForwardStmt" in self.runs else ""
                self.err("S021", f"`backward {m}` runs, but no graph runs `forward {m}` first{why}",
                         runs["BackwardStmt"], help=f"write `forward {m}; backward {m}`")
        pol = policy or (tv.get("barriers") if isinstance(tv.get("barriers"), str) else None) or \
            (self.barriers.policy.id if self.barriers else "auto")
        if pol not in POLICIES:
            span = dict(train_spans).get("barriers") or (self.barriers.policy.span if self.barriers else None)
            self.err("S015", f"unknown barrier policy `{pol}`", span, help=f"policies: {', '.join(POLICIES)}")
        cap = capture or tv.get("capture", "step")
        if cap not in CAPTURES:
            self.err("S015", f"unknown capture mode `{cap}`", dict(train_spans).get("capture"),
                     help=f"modes: {', '.join(CAPTURES)}")
        if self.diags:
            raise StreamschedError(self.diags)
        return Program(path, tuple((n, r) for n, (r, _) in self.streams.items()), tuple(self.buffers.values()),
                       tuple(self.inits.items()), tuple(graphs.values()), step, self.slots, self.model_info,
                       train_vals, train_spans, pol, cap, tuple(sorted(self.uploads)),
                       loss_scale=self.loss_scale, kernels=self.kernels)


def _graph_stmt_name(st) -> str:
    """How `after` in a graph body names a statement of it: an op call by its op (`nonfinite`),
    the others by their keyword (`forward`, `backward`, `clear`, `copy`), an upload as `upload.NAME`."""
    if isinstance(st, A.CallStmt):
        return st.call.func.id
    if isinstance(st, A.UploadStmt):
        return f"upload.{st.name.id}"
    return {A.CopyStmt: "copy", A.ClearStmt: "clear", A.ForwardStmt: "forward", A.BackwardStmt: "backward",
            A.SyncStmt: "synchronize", A.AllocStmt: "alloc"}.get(type(st), "")


def _at(span: Span | None) -> str:
    return f"{span.file}:{span.line}" if span is not None else "?"


def _shown(name: str) -> str:
    """A buffer name as the user wrote it: `x[{slot}]` -> `x`."""
    return name.replace(f"[{SLOT}]", "")


def _type_text(t: A.TypeExpr) -> str:
    def d(e):
        if isinstance(e, A.Var):
            return e.name.id
        if isinstance(e, A.Num):
            return str(e.value)
        return "?"

    if t.dims is None:
        return t.dtype.id
    return f"{t.dtype.id}[{', '.join(d(x) for x in t.dims)}]"


def _expr_names(e: A.Expr) -> set[str]:
    if isinstance(e, A.Var):
        return {e.name.id}
    if isinstance(e, A.Call):
        out: set[str] = set()
        for a in e.args:
            out |= _expr_names(a)
        return out
    if isinstance(e, A.BinOp):
        return _expr_names(e.left) | _expr_names(e.right)
    if isinstance(e, (A.Neg, A.Transpose)):
        return _expr_names(e.operand)
    return set()


def check_ops(res: Resolver) -> None:
    """Expand every user op body once on fresh parameter buffers, so hazards and unknown names
    inside an op are reported where it is defined, used or not."""
    # (Type-free: op parameters without types have no shapes; only names and streams are checked.)
    for op in res.ops.values():
        if op.name in res.stdlib_ops:
            continue
        try:
            if op.stream:
                res.stream(op.stream, False)
            assigned = {t.id for st in op.body for t in st.targets}
            for o in op.outs:
                if o.name.id not in assigned and o.name.id not in {p.name.id for p in op.params}:
                    res.err("S007", f"op `{op.name}` never assigns its output `{o.name.id}`", o.span,
                            help=f"add a statement `{o.name.id} = ...` to its body")
            _check_signature(res, op)
            defined = {p.name.id for p in op.params}
            for st in op.body:
                if st.clauses.on is not None:
                    res.stream(st.clauses.on, False)
                for n in _expr_names(st.expr):
                    if n not in defined and n not in {p.name.id for p in op.params}:
                        res.err("S007", f"unknown buffer `{n}` in op `{op.name}`", _find_var(st.expr, n) or st.span)
                if st.clauses.into is not None and st.clauses.into.id not in defined and \
                        st.clauses.into.id not in {t.id for t in st.targets}:  # (that one is S015)
                    res.err("S007", f"unknown buffer `{st.clauses.into.id}` in `into`", st.clauses.into.span,
                            help="`into` names a parameter or an earlier result of the same op")
                for t in st.targets:
                    defined.add(t.id)
                _check_kernel_names(res, st.expr)
        except _Abort:
            continue


def _check_signature(res: Resolver, op: A.OpDef) -> None:
    """The types and inits of an op's signature, checked where it is defined (used or not):
    known dtypes or dtype variables, a bare dtype only on an optimizer's state, known inits."""
    optimizer = any(p.modifier in ("grad", "param") for p in op.params)  # may run per parameter
    bound = {p.type.dtype.id for p in op.params if p.modifier is None and p.type is not None}
    for p in list(op.params) + [o for o in op.outs]:
        t = getattr(p, "type", None)
        if t is not None:
            if is_dtype_var(t.dtype.id) and t.dtype.id not in bound:
                res.err("S004", f"the dtype variable `{t.dtype.id}` is not bound by any input", t.dtype.span,
                        help="a dtype variable takes the dtype of the typed input it first appears in")
            elif not is_dtype_var(t.dtype.id) and t.dtype.id not in DTYPE_BYTES:
                res.err("S015", f"unknown dtype `{t.dtype.id}`", t.dtype.span,
                        help=f"dtypes: {', '.join(DTYPE_BYTES)}; a single capital letter (`T`) is a dtype variable")
            elif t.dims is None and not (optimizer and getattr(p, "modifier", None) == "state"):
                res.err("S015", f"`{t.dtype.id}` needs a shape here: `{t.dtype.id}[...]` (`{t.dtype.id}[]` for a "
                        "scalar)", t.span, help="a bare dtype is only the type of an optimizer's state")
        mod = getattr(p, "modifier", None)
        default = getattr(p, "default", None)
        if mod in ("param", "state") and isinstance(default, A.Var):
            ok = INITS + (("copy",) if mod == "state" and optimizer else ())
            if default.name.id not in ok:
                res.err("S015", f"unknown init `{default.name.id}`", default.span, help=f"inits: {', '.join(ok)}")


def _find_var(e: A.Expr, n: str) -> Span | None:
    if isinstance(e, A.Var) and e.name.id == n:
        return e.name.span
    for ch in (getattr(e, "args", ()) or ()) + tuple(x for x in (getattr(e, "left", None), getattr(e, "right", None),
                                                                 getattr(e, "operand", None)) if x is not None):
        s = _find_var(ch, n)
        if s:
            return s
    return None


def _check_kernel_names(res: Resolver, e: A.Expr) -> None:
    kernels = res.kernels
    if isinstance(e, A.Call):
        if e.func.id not in kernels and e.func.id not in res.kernel_defs:
            res.err("S014", f"unknown kernel `{e.func.id}`", e.func.span,
                    help="kernels are the stdlib primitives listed in docs/kernels.md, the file's `kernel` forms and those of `--kernels` modules")
        for a in e.args:
            _check_kernel_names(res, a)
    elif isinstance(e, A.BinOp):
        _check_kernel_names(res, e.left)
        _check_kernel_names(res, e.right)
    elif isinstance(e, (A.Neg, A.Transpose)):
        _check_kernel_names(res, e.operand)


def resolve(path: str, text: str | None = None, *, policy: str | None = None, capture: str | None = None,
            sources: SourceCache | None = None, kernels=None) -> Program:
    """Read, parse and resolve a `.sched` file (and its includes) into a `Program`.

    policy/capture override the file's settings (the command line wins); kernels: name -> Kernel
    records of `--kernels` modules (`streamsched.kernel_api.load_kernel_modules`), added to this
    program's table only.  Raises
    StreamschedError carrying every diagnostic found (P, S and C families), sorted later by the
    renderer.
    """
    sources = sources if sources is not None else SourceCache()
    files, diags = load_program_files(path, text, sources)
    if diags:
        raise StreamschedError(diags)
    res = Resolver(files, kernels)
    try:
        prog = res.run(path, policy, capture)
    except StreamschedError:
        raise
    digest = hashlib.sha256("\n".join(sources.texts.get(f.path, "") for f in files).encode()).hexdigest()[:16]
    user_ops = tuple(op for op in res.ops.values() if op.name not in res.stdlib_ops)
    return replace(prog, text_hash=digest, user_ops=user_ops)
