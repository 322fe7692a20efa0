"""AST to typed program: `resolve` reads the files and runs the resolver's passes in order
(`run_passes`): names and scopes, `kernel` forms, op bodies and placements checked, the train
block, the trained model's forward (types, shapes, op expansion) and its derived backward, the
`state` buffers, the graphs, the step.  User mistakes become P/S/C diagnostics, all collected,
never exceptions.

Source: LANGUAGE.md (the forms and their meaning) and the seed's op-to-stream policy.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from streamsched.diagnostics import SourceCache, StreamschedError
from streamsched.dsl.backward import SEED, derive_backward, grad_name
from streamsched.dsl.compose import check_blocks, check_line_places, inline_model
from streamsched.dsl.graphs import assign_slots, copies_inputs, expand_graphs
from streamsched.dsl.kernels import compile_kernel_defs
from streamsched.dsl.load import load_program_files
from streamsched.dsl.lower import Lowerer
from streamsched.dsl.model import expand_model
from streamsched.dsl.names import Streams, check_ops, check_places, collect
from streamsched.dsl.program import CallValue, Program
from streamsched.dsl.scope import Buffers, Scope, _Abort, stdlib_kernels
from streamsched.dsl.states import declare_states, plan_uploads
from streamsched.dsl.step import check_model_runs, resolve_step, settle_policy, train_settings, trained_model
from streamsched.dsl.types import is_dtype_var

__all__ = ["resolve", "run_passes", "Resolver", "CallValue", "SEED", "grad_name", "is_dtype_var", "_Abort"]


def resolve(path: str, text: str | None = None, *, policy: str | None = None, capture: str | None = None,
            sources: SourceCache | None = None, kernels=None) -> Program:
    """Read, parse and resolve a `.sched` file (and its includes) into a `Program`.

    policy/capture override the file's settings (the command line wins); kernels: name -> Kernel
    records of `--kernels` modules (`streamsched.kernel_api.load_kernel_modules`), added to this
    program's table only.  Raises StreamschedError carrying every diagnostic found (P, S and C
    families), sorted later by the renderer.
    """
    sources = sources if sources is not None else SourceCache()
    files, diags = load_program_files(path, text, sources)
    if diags:
        raise StreamschedError(diags)
    scope = Scope(files, kernels)
    prog = run_passes(scope, path, policy, capture)
    digest = hashlib.sha256("\n".join(sources.texts.get(f.path, "") for f in files).encode()).hexdigest()[:16]
    user_ops = tuple(op for op in scope.ops.values() if op.name not in scope.stdlib_ops)
    return replace(prog, text_hash=digest, user_ops=user_ops)


def run_passes(scope: Scope, path: str, policy: str | None, capture: str | None) -> Program:
    """The resolver's passes over the parsed files of `scope`, in order; each records its
    findings in scope.sink and goes on, so that one run reports every mistake.  Raises
    StreamschedError with them all when there is any."""
    buffers, streams = Buffers(scope.sink), Streams(scope)
    lower = Lowerer(scope, buffers, streams)
    # Names and scopes: every item by name, the file's kernels, op bodies and placements where
    # they are written (used or not).
    collect(scope)
    scope.kernels.update(compile_kernel_defs(scope, list(scope.kernel_defs.values()), stdlib_kernels(),
                                             scope.kernel_origins))
    check_ops(scope, streams)
    check_places(scope, streams)
    check_blocks(scope)
    # The train block says which model is trained.
    train = train_settings(scope)
    model_ast = trained_model(scope, train)
    assign_slots(scope, buffers)
    plan_uploads(scope, buffers)
    # The model: its forward (types, shapes, op expansion), then the backward derived from it.
    model, bwd = None, []
    if model_ast is not None:
        model_ast = inline_model(scope, model_ast)  # composite ops and `repeat` become model lines
        check_line_places(scope)
        try:
            forward = expand_model(scope, buffers, streams, lower, model_ast,
                                   copies_inputs(scope) and bool(buffers.slots))
            bwd = derive_backward(scope, buffers, streams, lower, forward)
            model = forward.info
        except _Abort:
            scope.broken_models.add(model_ast.name.id)
    # Graphs and step.
    declare_states(scope, buffers)
    graphs = expand_graphs(scope, buffers, streams, lower, model, bwd)
    before = len(scope.diags)
    step = resolve_step(scope, buffers, streams, graphs.infos, graphs.failed)
    if model is not None and not graphs.failed:  # a rejected graph may hold the forward or backward
        # A step with mistakes of its own is reported, not followed up: every graph counts then.
        check_model_runs(scope, graphs, step, bool(scope.steps) and len(scope.diags) == before, model.name)
    pol, cap = settle_policy(scope, train, policy, capture)
    if graphs.failed and not scope.diags:  # a backstop: a graph is only left out for a reported mistake
        for name in sorted(graphs.failed):
            scope.sink.err("S008", f"graph `{name}` could not be resolved", scope.graphs_ast[name].name.span)
    if scope.diags:
        raise StreamschedError(scope.diags)
    return Program(path, tuple((n, r) for n, (r, _) in scope.streams.items()), tuple(buffers.buffers.values()),
                   tuple(buffers.inits.items()), tuple(graphs.infos.values()), step, buffers.slots, model,
                   train.values, train.spans, pol, cap, tuple(sorted(buffers.uploads)),
                   loss_scale=graphs.loss_scale, kernels=scope.kernels)


class Resolver(Scope):
    """A Scope whose passes a caller runs itself, for tests that stop after some of them
    (`collect()`, then `compile_kernel_defs(res, ...)`); `run` runs them all (`run_passes`)."""

    def collect(self) -> None:
        collect(self)

    def run(self, path: str, policy: str | None = None, capture: str | None = None) -> Program:
        return run_passes(self, path, policy, capture)
