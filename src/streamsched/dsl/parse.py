"""Text to AST: `parse(text, path) -> File`, raising `StreamschedError` with P-family
diagnostics (never a lark exception) whose messages name tokens the way people do.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import sys
from functools import lru_cache

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.dsl import ast as A
from streamsched.dsl.parser_tables import load_parser
from streamsched.interp.ir import AfterClause, Span

# lark's terminal names, as a person would say them (STYLE.md habit 4).
_TOKEN_WORDS = {
    "$END": "end of file",
    "LBRACE": "`{`", "RBRACE": "`}`", "LPAR": "`(`", "RPAR": "`)`", "LSQB": "`[`", "RSQB": "`]`",
    "COMMA": "`,`", "COLON": "`:`", "SEMICOLON": "`;`", "EQUAL": "`=`", "DOT": "`.`",
    "PLUS": "`+`", "MINUS": "`-`", "STAR": "`*`", "SLASH": "`/`", "NAME": "a name",
    "NUMBER": "a number", "STRING": "a string", "MODIFIER": "`param`, `grad` or `state`",
    "__ANON_0": "`->`", "__ANON_1": "`^T`", "RARROW": "`->`", "CMP": "a comparison",
}
# Anonymous terminals lark numbers in grammar order: named by their text instead.
_TEXT_WORDS = {"->": "`->`", "^T": "`^T`", "...": "`...`", "**": "`**`"}


def _word(term: str) -> str:
    if term.startswith("__ANON_"):
        pattern = _anon_patterns().get(term)
        if pattern in _TEXT_WORDS:
            return _TEXT_WORDS[pattern]
    if term in _TOKEN_WORDS:
        return _TOKEN_WORDS[term]
    if term.isupper() and term.isalpha():
        return f"`{term.lower()}`"
    return term


@lru_cache(maxsize=1)
def _parser() -> Lark:
    """Built once per process, from the stored tables when they are fresh (parser_tables.py)."""
    return load_parser()


@lru_cache(maxsize=1)
def _anon_patterns() -> dict[str, str]:
    """lark's anonymous terminal names (`__ANON_0`) -> the text they match (`->`)."""
    return {t.name: t.pattern.value for t in _parser().terminals if t.name.startswith("__ANON_")}


_PLACE_SEG = re.compile(r"(\.)?([A-Za-z_][A-Za-z0-9_]*|\d+)(\.)?")
_PLACE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|\d+))*")


_FLOAT_MAX_INT = int(sys.float_info.max)
NUMBER_RANGE = "a number must be finite as a float (at most about 1.8e308 in magnitude)"


def number_in_range(v) -> bool:
    """Whether `v` is a number streamsched accepts (NUMBER_RANGE): one that every later pass, the
    kernels' attributes and the data sources may convert to a float without overflow (`1e999`
    reads as infinity; an integer past 2^1024 has no float)."""
    if isinstance(v, bool):
        return True
    if isinstance(v, int):
        return abs(v) <= _FLOAT_MAX_INT
    if isinstance(v, float):
        return math.isfinite(v)
    return True



class _ToAst(Transformer):
    """Builds AST records; every node gets a Span from lark's meta."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.diags: list[Diagnostic] = []  # mistakes the grammar lets through (a clause given twice)
        # lark binds a `v_args` callback anew (functools.update_wrapper included) at every node it
        # visits; bound once here, on the instance, the callbacks are plain attribute reads
        for name, member in _VARGS_CALLBACKS:
            setattr(self, name, member.__get__(self, type(self)))

    def release(self) -> None:
        """Drop the bound callbacks (each refers back to the instance: a cycle left to the collector)."""
        for name, _ in _VARGS_CALLBACKS:
            self.__dict__.pop(name, None)

    def _sp(self, meta) -> Span | None:
        if getattr(meta, "empty", True):
            return None
        return Span(self.path, meta.line, meta.column, meta.end_line, meta.end_column)

    def _tok(self, t: Token) -> A.Name:
        return A.Name(str(t), Span(self.path, t.line, t.column, t.end_line, t.end_column))

    def NAME(self, t):  # noqa: N802 (lark callback)
        return self._tok(t)

    # ---- generic pieces
    @v_args(meta=True)
    def start(self, meta, items):
        return tuple(i for i in items if i is not None)

    def empty(self, _):
        return None

    @v_args(meta=True)
    def type(self, meta, ch):
        dims = tuple(d for d in ch[1:] if d is not None)
        return A.TypeExpr(ch[0], dims, self._sp(meta))

    @v_args(meta=True)
    def ref(self, meta, ch):
        index = ch[-1]
        parts = tuple(ch[:-1])
        return A.Ref(parts, index, self._sp(meta))

    @v_args(meta=True)
    def dotted(self, meta, ch):
        return (".".join(n.id for n in ch), self._sp(meta))

    @v_args(meta=True)
    def number(self, meta, ch):
        s = str(ch[0])
        v = float(s) if any(c in s for c in ".eE") else int(s)
        if not number_in_range(v):
            self.diags.append(Diagnostic(
                "P007", f"the number `{s if len(s) <= 40 else s[:37] + '...'}` is out of range: " + NUMBER_RANGE,
                self._sp(meta), help="write a smaller number"))
            v = 0
        return A.Num(v, self._sp(meta))

    @v_args(meta=True)
    def string(self, meta, ch):
        return A.Str(str(ch[0])[1:-1], self._sp(meta))

    @v_args(meta=True)
    def var(self, meta, ch):
        return A.Var(ch[0], self._sp(meta))

    @v_args(meta=True)
    def dotted_var(self, meta, ch):
        # `tok.table`: a line's parameter, named where a `param` is tied to it (weight tying)
        sp = self._sp(meta)
        return A.Var(A.Name(str(ch[0]), sp), sp)

    @v_args(meta=True)
    def kwarg(self, meta, ch):
        return A.KwArg(ch[0], ch[1], self._sp(meta))

    def arglist(self, ch):
        return list(ch)

    @v_args(meta=True)
    def call(self, meta, ch):
        args = ch[1] or []
        pos = tuple(a for a in args if not isinstance(a, A.KwArg))
        kws = tuple(a for a in args if isinstance(a, A.KwArg))
        return A.Call(ch[0], pos, kws, self._sp(meta))

    def _bin(op):  # noqa: N805
        @v_args(meta=True)
        def f(self, meta, ch):
            return A.BinOp(op, ch[0], ch[1], self._sp(meta))

        return f

    add = _bin("+")
    sub = _bin("-")
    mul = _bin("*")
    div = _bin("/")

    pow = _bin("**")

    @v_args(meta=True)
    def compare(self, meta, ch):
        return A.Compare(str(ch[1]), ch[0], ch[2], self._sp(meta))

    @v_args(meta=True)
    def dots(self, meta, ch):
        return A.Dots(self._sp(meta))

    @v_args(meta=True)
    def neg(self, meta, ch):
        return A.Neg(ch[0], self._sp(meta))

    @v_args(meta=True)
    def transpose(self, meta, ch):
        return A.Transpose(ch[0], self._sp(meta))

    def targets(self, ch):
        return tuple(ch)

    @v_args(meta=True)
    def on_clause(self, meta, ch):
        return ("on", ch[0], self._sp(meta))

    @v_args(meta=True)
    def into_clause(self, meta, ch):
        return ("into", ch[0], self._sp(meta))

    @v_args(meta=True)
    def after_clause(self, meta, ch):
        return ("after", tuple(ch), self._sp(meta))

    def _clauses(self, items, head=()) -> A.Clauses:
        """Clauses of one statement; `head` are the statement's other children, so `tail` (the
        insertion point after the last token, before any `;`) can be found."""
        on = into = into_span = None
        after: tuple = ()
        after_clauses: tuple = ()
        for kind, v, sp in items:
            if kind in ("on", "into") and (on if kind == "on" else into) is not None:
                first = on if kind == "on" else into
                self.diags.append(Diagnostic(
                    "P006", f"`{kind}` is given twice in one statement (`{kind} {first.id}` and `{kind} {v.id}`)", sp,
                    help=f"keep one `{kind}` clause: a statement runs on one stream and reuses at most one buffer"))
            if kind == "on":
                on = v
            elif kind == "into":
                into, into_span = v, sp
            else:
                after = after + v
                if sp is not None:
                    after_clauses += (AfterClause(sp, tuple((r.text, r.span) for r in v)),)
        ends = [sp for _, _, sp in items if sp is not None] + [s for s in map(_span_of, head) if s is not None]
        tail = None
        if ends:
            last = max(ends, key=lambda s: (s.end_line, s.end_col))
            tail = Span(last.file, last.end_line, last.end_col, last.end_line, last.end_col)
        return A.Clauses(on, into, after, into_span, after_clauses, tail)

    # ---- streams, ops, place
    @v_args(meta=True)
    def stream_decl(self, meta, ch):
        return A.StreamDecl(ch[0], ch[1], self._sp(meta))

    @v_args(meta=True)
    def streams_block(self, meta, ch):
        return A.Streams(tuple(ch), self._sp(meta))

    def op_params(self, ch):
        return tuple(ch)

    @v_args(meta=True)
    def op_param(self, meta, ch):
        mod, name, typ, default = ch
        return A.OpParam(str(mod) if mod is not None else None, name, typ, default, self._sp(meta))

    @v_args(meta=True)
    def op_param_named_like_modifier(self, meta, ch):
        """`op f(state)`: a plain parameter that happens to be called `state`, `param` or `grad`."""
        mod, typ, default = ch
        return A.OpParam(None, self._tok(mod), typ, default, self._sp(meta))

    def op_outs(self, ch):
        return tuple(ch)

    @v_args(meta=True)
    def out_decl(self, meta, ch):
        return A.OutDecl(ch[0], ch[1], self._sp(meta))

    @v_args(meta=True)
    def kernel_stmt(self, meta, ch):
        return A.KernelStmt(ch[0], ch[1], self._clauses(ch[2:], ch[:2]), self._sp(meta))

    @v_args(meta=True)
    def op_def(self, meta, ch):
        (name, nspan), params, outs, stream, *body = ch
        return A.OpDef(name, nspan, params or (), outs, stream, tuple(body), self._sp(meta))

    # ---- kernels
    def kernel_params(self, ch):
        return tuple(ch)

    @v_args(meta=True)
    def kernel_input(self, meta, ch):
        return A.KernelParam(ch[0], ch[1], None, self._sp(meta))

    @v_args(meta=True)
    def kernel_attr(self, meta, ch):
        return A.KernelParam(ch[0], None, ch[1], self._sp(meta))

    def kernel_outs(self, ch):
        return tuple(ch)

    out_kdecl = out_decl
    ktype = type

    @v_args(meta=True)
    def kernel_assign(self, meta, ch):
        return A.KernelAssign(ch[0], ch[1], self._sp(meta))

    @v_args(meta=True)
    def kernel_def(self, meta, ch):
        name, params, outs, *body = ch
        return A.KernelDef(name, params or (), outs, tuple(body), self._sp(meta))

    def _seg(self, t) -> tuple[str, Span]:
        if isinstance(t, A.Name):
            return t.id, t.span
        return str(t), Span(self.path, t.line, t.column, t.end_line, t.end_column)

    def seg_name(self, ch):  # `.k` (and, as seg_num, `.2`)
        t, sp = self._seg(ch[0])
        return ("." + t, sp)

    seg_num = seg_name

    def seg_glued(self, ch):
        return self._seg(ch[0])

    @v_args(meta=True)
    def place_path(self, meta, ch):
        (text, head), segs = self._seg(ch[0]), ch[1:]
        bad = None
        for t, tok in segs:
            if bad is None and not t.startswith(".") and not text.endswith("."):
                self.diags.append(Diagnostic("P002", f"unexpected `{t}`: a `.` is missing before it", tok,
                                             help=f"join a line's name with dots: `{text}.{t}`"))
                return (text + "." + t, self._sp(meta))
            if bad is None and not _PLACE_SEG.fullmatch(t):
                bad = tok
            text += t
        if bad is None and not _PLACE_PATH.fullmatch(text):
            bad = segs[-1][1] if segs else head
        if bad is not None:
            self.diags.append(Diagnostic(
                "P002", f"`{text}` is not a line's name: segments are names or whole numbers, joined by `.`", bad,
                help="name a model line (`h1`), a block's line (`y.k`) or an instance's line (`h.2.k`)"))
        return (text, self._sp(meta))

    @v_args(meta=True)
    def place_stmt(self, meta, ch):
        (target, tspan), stream = ch
        return A.Place(target, tspan, stream, self._sp(meta))

    # ---- models
    def kwlist(self, ch):
        return tuple(ch)

    @v_args(meta=True)
    def input_decl(self, meta, ch):
        return A.InputDecl(ch[0], ch[1], self._sp(meta))

    @v_args(meta=True)
    def op_use(self, meta, ch):
        return A.OpUse(ch[0], ch[1], self._clauses(ch[2:], ch[:2]), self._sp(meta))

    @v_args(meta=True)
    def op_repeat(self, meta, ch):
        targets, count, call, *cl = ch
        return A.OpUse(targets, call, self._clauses(cl, (targets, call)), self._sp(meta), repeat=count)

    @v_args(meta=True)
    def model_def(self, meta, ch):
        name, params, *body = ch
        return A.ModelDef(name, params or (), tuple(body), self._sp(meta))

    # ---- graphs
    def slots(self, ch):
        return tuple(ch)

    @v_args(meta=True)
    def copy_stmt(self, meta, ch):
        return A.CopyStmt(ch[0], tuple(ch[1:]), self._sp(meta))

    @v_args(meta=True)
    def clear_stmt(self, meta, ch):
        return A.ClearStmt(ch[0], self._sp(meta))

    @v_args(meta=True)
    def forward_stmt(self, meta, ch):
        return A.ForwardStmt(ch[0], self._sp(meta))

    @v_args(meta=True)
    def backward_stmt(self, meta, ch):
        return A.BackwardStmt(ch[0], self._sp(meta), ch[1])

    @v_args(meta=True)
    def upload_stmt(self, meta, ch):
        return A.UploadStmt(ch[0], ch[1], A.Clauses(), self._sp(meta))

    @v_args(meta=True)
    def sync_stmt(self, meta, ch):
        return A.SyncStmt(self._sp(meta))

    step_sync = sync_stmt

    @v_args(meta=True)
    def alloc_stmt(self, meta, ch):
        return A.AllocStmt(ch[0], ch[1], self._sp(meta))

    @v_args(meta=True)
    def call_stmt(self, meta, ch):
        return A.CallStmt(ch[0], self._clauses(ch[1:], ch[:1]), self._sp(meta))

    @v_args(meta=True)
    def graph_def(self, meta, ch):
        name, slots, stream, *body = ch
        return A.GraphDef(name, slots or (), stream, tuple(body), self._sp(meta))

    # ---- steps, train
    @v_args(meta=True)
    def launch_args(self, meta, ch):
        return _Spanned(tuple(c for c in ch if c is not None), self._sp(meta))

    @v_args(meta=True)
    def launch_stmt(self, meta, ch):
        ref, binds, *cl = ch
        head = (ref,) + ((binds,) if binds is not None else ())
        return A.LaunchStmt(ref, tuple(binds) if binds is not None else None, self._clauses(cl, head), self._sp(meta))

    @v_args(meta=True)
    def step_upload(self, meta, ch):
        name, *cl = ch
        c = self._clauses(cl, (name,))
        return A.UploadStmt(name, c.on, c, self._sp(meta))

    @v_args(meta=True)
    def step_def(self, meta, ch):
        name, param, *body = ch
        return A.StepDef(name, param, tuple(body), self._sp(meta))

    @v_args(meta=True)
    def train_item(self, meta, ch):
        return A.TrainItem(ch[0], ch[1], self._sp(meta))

    @v_args(meta=True)
    def train_block(self, meta, ch):
        return A.TrainBlock(ch[0], tuple(ch[1:]), self._sp(meta))

    @v_args(meta=True)
    def barriers_stmt(self, meta, ch):
        return A.Barriers(ch[0], self._sp(meta))

    @v_args(meta=True)
    def state_decl(self, meta, ch):
        return A.StateDecl(ch[0], ch[1], ch[2], self._sp(meta))

    @v_args(meta=True)
    def state_block(self, meta, ch):
        return A.StateBlock(tuple(ch), self._sp(meta))

    @v_args(meta=True)
    def bare_type(self, meta, ch):
        return A.TypeExpr(ch[0], None, self._sp(meta))

    @v_args(meta=True)
    def include_stmt(self, meta, ch):
        return A.Include(str(ch[0])[1:-1], self._sp(meta))


class _Spanned(tuple):
    """A tuple of AST nodes that remembers the span of its brackets (`pass(load[slot])`)."""

    def __new__(cls, items, span):
        t = super().__new__(cls, items)
        t.span = span
        return t


def _span_of(node) -> Span | None:
    """The span covering an AST node or a tuple of them (None when nothing has one)."""
    if isinstance(node, _Spanned) and node.span is not None:
        return node.span
    if isinstance(node, tuple):
        spans = [s for s in map(_span_of, node) if s is not None]
        if not spans:
            return None
        lo = min(spans, key=lambda s: (s.line, s.col))
        hi = max(spans, key=lambda s: (s.end_line, s.end_col))
        return Span(lo.file, lo.line, lo.col, hi.end_line, hi.end_col)
    return getattr(node, "span", None)


def _expected(exc: UnexpectedInput) -> str:
    exp = sorted({_word(t) for t in (getattr(exc, "expected", None) or getattr(exc, "allowed", None) or ())})
    if not exp:
        return ""
    if len(exp) > 8:
        exp = exp[:8] + ["..."]
    return "expected " + ", ".join(exp)


def _parse_error(exc: UnexpectedInput, text: str, path: str) -> Diagnostic:
    lines = text.splitlines()
    if isinstance(exc, UnexpectedEOF) or (isinstance(exc, UnexpectedToken) and exc.token.type == "$END"):
        # Point at the last non-blank character: "unclosed ... at end of file".
        ln = len(lines)
        while ln > 1 and not lines[ln - 1].strip():
            ln -= 1
        last = lines[ln - 1] if lines else ""
        col = max(1, len(last.rstrip()))
        expected = getattr(exc, "expected", None) or ()
        if "RBRACE" in expected:
            msg = "unexpected end of file: a `{` block is not closed"
            help_ = "add the missing `}`"
        else:
            msg = "unexpected end of file"
            help_ = _expected(exc)
        return Diagnostic("P001", msg, Span(path, max(ln, 1), col, max(ln, 1), col + 1), help=help_)
    if isinstance(exc, UnexpectedCharacters):
        ch = text[exc.pos_in_stream] if 0 <= exc.pos_in_stream < len(text) else "?"
        return Diagnostic(
            "P003",
            f"unexpected character `{ch}`",
            Span(path, exc.line, exc.column, exc.line, exc.column + 1),
            help=_expected(exc) or "remove it",
        )
    tok = exc.token  # UnexpectedToken
    val = str(tok)
    end_col = (tok.end_column or (tok.column + max(1, len(val))))
    what = f"`{val}`" if tok.type not in ("$END",) else "end of file"
    misnamed = _misnamed_block(text, getattr(tok, "start_pos", None), path)
    if misnamed is not None:  # `stream {`: a typo in a block's name, seen as an unknown block
        name, span, guess = misnamed
        return Diagnostic("P002", f"unknown {'block' if guess in _BRACED else 'keyword'} `{name}`",
                          span, help=f"did you mean `{guess}{' {' if guess in _BRACED else ''}`?")
    return Diagnostic(
        "P002",
        f"unexpected {what}",
        Span(path, tok.line, tok.column, tok.end_line or tok.line, end_col),
        help=_expected(exc),
    )


_BLOCKS = ("streams", "state", "model", "graph", "step", "train", "op", "kernel", "place", "barriers", "include")
_BRACED = ("streams", "state", "train")


def _misnamed_block(text: str, pos: int | None, path: str) -> tuple[str, Span, str] | None:
    """When the error lies inside a top-level `NAME {` block whose NAME is not a keyword but
    close to one (`stream`, `Streams`, `modle`): (NAME, its span, the keyword).  The grammar
    reads any `NAME {` as a train-like block, so a typo there otherwise fails at the first line
    of its body, far from the mistake."""
    if pos is None:
        return None
    depth, start, item = 0, None, 0  # item: where the current top-level item starts
    for m in re.finditer(r"#[^\n]*|\"[^\"\n]*\"|[{};]", text[:pos]):
        t = m.group()
        if t == "{":
            if depth == 0:
                start = m.start()
            depth += 1
        elif t == "}":
            depth = max(0, depth - 1)
            if depth == 0:
                item = m.end()
        elif t == ";" and depth == 0:
            item = m.end()
    # the first word of the current top-level item (comments blanked, offsets kept)
    blank = re.sub(r"#[^\n]*", lambda c: " " * len(c.group()), text[item:pos])
    head = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)", blank)
    if head is None:
        return None
    name, head_start = head.group(1), item + head.start(1)
    if depth > 0 and blank[head.end(1):start - item].strip():
        return None  # `graph g on steps {`: inside a block whose header is more than `NAME {`
    if name in _BLOCKS:
        return None
    guess = difflib.get_close_matches(name.lower(), [b for b in _BLOCKS if b != "train"], n=1, cutoff=0.75)
    if not guess:
        return None
    line = text.count("\n", 0, head_start) + 1
    col = head_start - (text.rfind("\n", 0, head_start) + 1) + 1
    return name, Span(path, line, col, line, col + len(name)), guess[0]


MAX_NESTING = 100
"""How deep one expression may nest (calls, operators, unary minus, `^T`): the AST and every
pass after it are built by recursion, so a fixed limit far below Python's keeps them all safe."""

# The grammar rules that nest one expression level (parentheses alone build no node).
_NESTING_RULES = frozenset({"call", "add", "sub", "mul", "div", "neg", "transpose", "pow", "compare"})


def _rule_span(tree: Tree, path: str) -> Span | None:
    meta = tree.meta
    if getattr(meta, "empty", True):
        return None
    return Span(path, meta.line, meta.column, meta.end_line, meta.end_column)


def _nesting(tree: Tree, path: str) -> tuple[int, Span | None]:
    """How deep expressions nest in `tree`, and the span of the outermost expression around the
    deepest point (where the nesting starts).  Iterative, so safe however deep the tree is."""
    best, where = 0, None
    stack: list[tuple[Tree, int, Tree | None]] = [(tree, 0, None)]
    while stack:
        node, depth, outer = stack.pop()
        if node.data in _NESTING_RULES:
            depth += 1
            outer = outer or node
            if depth > best:
                best, where = depth, outer
        for child in node.children:
            if isinstance(child, Tree):
                stack.append((child, depth, outer))
    return best, (_rule_span(where, path) if where is not None else None)


def _deepest_line(text: str, path: str) -> Span:
    """Where parentheses nest deepest: the `(` that opens the outermost group around the deepest
    point (a fallback position when only a RecursionError is known; comments and strings skipped)."""
    depth = best = 0
    opens: list[int] = []
    best_pos = 0
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "#":
            nl = text.find("\n", i)
            i = n if nl < 0 else nl
            continue
        if ch == '"':
            end = text.find('"', i + 1)
            i = n if end < 0 else end + 1
            continue
        if ch == "(":
            opens.append(i)
            depth += 1
            if depth > best:
                best, best_pos = depth, opens[0]
        elif ch == ")" and opens:
            opens.pop()
            depth -= 1
        i += 1
    line = text.count("\n", 0, best_pos) + 1
    col = best_pos - (text.rfind("\n", 0, best_pos) + 1) + 1
    return Span(path, line, col, line, col + 1)


def _nesting_error(span: Span) -> StreamschedError:
    return StreamschedError([Diagnostic(
        "P004", f"expression nested too deeply (more than {MAX_NESTING} levels)", span,
        help="split it into several statements, naming the intermediate results")])


_VARGS_CALLBACKS = tuple((name, member) for name in dir(_ToAst)
                         if type(member := inspect.getattr_static(_ToAst, name)).__name__ == "_VArgsWrapper")
"""The `v_args` callbacks of _ToAst (and its bases), bound per instance in its __init__."""


def parse(text: str, path: str = "<string>") -> A.File:
    """Parse `.sched` text into a `File`.

    Raises StreamschedError with one P-family diagnostic (P001 unexpected end of file,
    P002 unexpected token, P003 unexpected character, P004 expression nested too deeply) on a
    syntax error, P006 for each `on` or `into` clause given twice in one statement, and P007
    for each number out of range (NUMBER_RANGE).
    """
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as exc:
        raise StreamschedError([_parse_error(exc, text, path)]) from None
    except RecursionError:  # pathological nesting
        raise _nesting_error(_deepest_line(text, path)) from None
    depth, span = _nesting(tree, path)
    if depth > MAX_NESTING:
        raise _nesting_error(span or _deepest_line(text, path))
    try:
        builder = _ToAst(path)
        try:
            items = builder.transform(tree)
        finally:
            builder.release()
    except RecursionError:  # a backstop: the check above keeps the recursion far from the limit
        raise _nesting_error(span or _deepest_line(text, path)) from None
    except VisitError as exc:  # lark wraps what a callback raises
        if isinstance(exc.orig_exc, RecursionError):
            raise _nesting_error(span or _deepest_line(text, path)) from None
        raise
    if builder.diags:
        raise StreamschedError(builder.diags)
    return A.File(path, items)
