"""The `streamsched` command: check, lower, graph, trace, run (and --version).

Exit status: 0 clean, 1 on any user-facing error (always a diagnostic with a code, never a
traceback), bad command-line usage included (X004; argparse's own status would be 2).  An internal
failure names the pass and asks for a bug report (3).  SIGINT, SIGTERM and SIGHUP end a command as
128 + the signal (130, 143, 129) at any moment, start-up included, without a traceback; a run first
says which checkpoint holds which epoch and the command that resumes it.  Every output a command
writes is checked before any work (streamsched.outputs).

Standard output and standard error are feedback, never the work (`_Feedback`): a reader that stops
reading (`streamsched lower F | head`, `run ... 2>&1 | head`), a closed stream (`>&-`, `2>&-`) or
one that cannot be written never stops a command or shows a traceback, and a run goes on to its
end with its checkpoint and log.  The exit status is the command's own (a cut pipe does not turn
`check`'s 1 into 0, nor a stopped run into a success); a stream that failed for another reason
than a reader that went away or a stream closed on purpose (a full disk: ENOSPC, EFBIG, EIO) makes
it 1, with X021 naming the stream on the other one when that one still works.
"""

from __future__ import annotations

# Only what `main` needs to catch an interrupt is imported with the module: an interrupt during
# the other imports (`_load`, inside main's handler) is a clean message too, not a traceback.
# (os and sys are loaded by the interpreter before any of this runs.)
import os
import sys


def _load() -> None:
    """The module's other imports, done by `main` under its interrupt handler."""
    global argparse, errno, signal, time, traceback, __version__, Diagnostic, InternalError, SourceCache
    global StreamschedError, render_all, ArgumentParser, note_caught, clear_caught
    import argparse
    import errno
    import signal
    import time
    import traceback

    from streamsched import __version__
    from streamsched.diagnostics import Diagnostic, InternalError, SourceCache, StreamschedError, render_all
    from streamsched.interp.training.signals import clear_caught, note_caught

    if "ArgumentParser" not in globals():
        ArgumentParser = _argument_parser(argparse)


def _print_diags(diags, sources: SourceCache, fmt: str, stream=None) -> None:
    if not diags:
        return
    print(render_all(diags, sources, fmt), file=sys.stdout if fmt == "json" else stream or sys.stderr)


def _compile(args, sources: SourceCache, path: str):
    from streamsched.pipeline import compile_file

    return compile_file(path, policy=args.policy, capture=getattr(args, "capture", None), sources=sources,
                        kernels=_kernel_modules(args), fuse=not getattr(args, "no_fuse", False))


def _kernel_modules(args):
    """The `--kernels` modules' records, imported once per command (X015 when one cannot be)."""
    names = getattr(args, "kernels", None) or []
    if not names:
        return None
    if getattr(args, "_kernel_table", None) is None:
        from streamsched.kernel_api import load_kernel_modules

        if getattr(args, "_kernel_error", False):  # reported with the first file already
            raise StreamschedError([])
        try:
            args._kernel_table = load_kernel_modules(names)
        except StreamschedError:
            args._kernel_error = True
            raise
    return args._kernel_table


def _compiled_or_report(args, sources: SourceCache):
    """Compile `args.file`; on P/S/C mistakes print them and return None (the caller exits 1)."""
    try:
        return _compile(args, sources, args.file)
    except StreamschedError as e:
        _print_diags(e.diagnostics, sources, "text")
        return None


def _includes(sources: SourceCache, program_path: str) -> tuple[str, ...]:
    """The files the program includes: every file the loader read for it but the program itself."""
    return tuple(p for p in sources.texts if not p.startswith("<") and not _same(p, program_path))


def _same(a: str, b: str) -> bool:
    from streamsched.outputs import same_file

    return same_file(a, b)


def _outputs(c, sources: SourceCache, wanted: list[tuple[str | None, str, str, str]]):
    """Check the outputs of lower/graph/trace before any work (outputs.check_output): each of
    `wanted` is (path or None, kind, noun, option); none may be the program, an include or a data
    file of its train block, a file of another kind, or another of these outputs.  Returns the
    Outputs (None where no path was given); raises StreamschedError X021."""
    from streamsched.interp.train import TrainOptions, _call, _run_inputs, setting_dir
    from streamsched.dsl.resolve import CallValue
    from streamsched.outputs import check_distinct, check_output

    program = c.program
    tv, spans = dict(program.train), dict(program.train_spans)
    top = os.path.dirname(os.path.abspath(program.path))
    data = _call(tv.get("data", CallValue("digits", (), ())), "digits")
    inputs = _run_inputs(program, TrainOptions(protect=_includes(sources, program.path)), data,
                         setting_dir(spans.get("data"), top))
    outs = [check_output(p, kind, noun=noun, origin=flag, inputs=inputs) if p else None
            for p, kind, noun, flag in wanted]
    check_distinct(outs)
    return outs


def cmd_check(args) -> int:
    sources = SourceCache()
    all_diags: list[Diagnostic] = []
    for path in args.files:
        try:
            c = _compile(args, sources, path)
            all_diags.extend(c.diagnostics)
            from streamsched.interp.train import check_train_settings

            all_diags.extend(check_train_settings(c.program, _includes(sources, path)))
        except StreamschedError as e:
            all_diags.extend(e.diagnostics)
        except OSError as exc:  # a file that cannot be read is a diagnostic too (JSON under --format json)
            all_diags.append(Diagnostic("X002", f"cannot read `{path}`: {exc.strerror or exc}",
                                        help="check the path; `streamsched check` takes .sched files"))
    errors = [d for d in all_diags if d.severity == "error"]
    if args.format == "json":
        print(render_all(all_diags, sources, "json"))  # `[]` when clean: always valid JSON
    else:
        _print_diags(all_diags, sources, "text")
        if not errors:
            print(f"ok: {', '.join(args.files)} check{'s' if len(args.files) == 1 else ''} clean", file=sys.stderr)
    return 1 if errors else 0


def cmd_lower(args) -> int:
    from streamsched.interp.plan_text import format_plan
    from streamsched.outputs import replaced

    sources = SourceCache()
    c = _compiled_or_report(args, sources)
    if c is None:
        return 1
    if c.plan is not None:
        if args.output:
            try:
                (out,) = _outputs(c, sources, [(args.output, "plan", "the plan", "-o")])
            except StreamschedError as e:
                _print_diags(e.diagnostics, sources, "text")
                return 1
        text = format_plan(c.plan, sources)
        if args.output:
            try:
                with replaced(out) as tmp:
                    with open(tmp, "w", encoding="utf-8") as f:
                        f.write(text + "\n")
            except OSError as exc:
                _print_diags([Diagnostic("X021", f"cannot write `{args.output}`: {exc.strerror or exc}",
                                         help="name a file in an existing folder you can write to")],
                             sources, "text")
                return 1
        else:
            print(text)
    _print_diags(c.diagnostics, sources, "text")
    return 0 if c.ok else 1


def cmd_graph(args) -> int:
    from streamsched.interp.draw import write_graph

    sources = SourceCache()
    c = _compiled_or_report(args, sources)
    if c is None:
        return 1
    if c.plan is None:
        _print_diags(c.diagnostics, sources, "text")
        return 1
    from streamsched.outputs import replaced

    try:
        (out,) = _outputs(c, sources, [(args.output, "graph", "the drawing", "-o")])
    except StreamschedError as e:
        _print_diags(e.diagnostics, sources, "text")
        return 1
    if args.captured:
        try:  # no GPU is X020, as for `run --backend cuda` and `trace`, before any capture is tried
            from streamsched.interp.cuda import cuda_available

            ok, why = cuda_available()
            if ok:
                from streamsched.interp.cuda.capture_dot import write_captured_dot
        except ImportError as exc:
            ok, why = False, f"the CUDA backend cannot load: {exc}"
        if not ok:
            _print_diags([Diagnostic("X020", f"--captured draws the CUDA graphs as captured on the GPU: no usable "
                                             f"GPU ({why})",
                                     help="install streamsched[cuda12] or [cuda13] on a machine with an NVIDIA "
                                          "GPU, or draw the plan without --captured")], sources, "text")
            return 1
        try:
            with replaced(out) as tmp:
                write_captured_dot(c, tmp)
        except OSError as exc:
            _print_diags([Diagnostic("X021", f"cannot write `{args.output}`: {exc.strerror or exc}",
                                     help="name a file in an existing folder you can write to")], sources, "text")
            return 1
        except Exception as exc:  # a CUDA failure is a run-time diagnostic, not a traceback
            task = getattr(exc, "task", None)
            d = Diagnostic("X011", f"capture failed: {exc}", getattr(task, "span", None))
            _print_diags([d], sources, "text")
            return 1
    else:
        try:
            with replaced(out) as tmp:
                write_graph(c.plan, tmp)
        except (RuntimeError, ValueError, OSError) as exc:
            print(f"error[X021]: cannot write `{args.output}`: {exc}", file=sys.stderr)
            return 1
    print(f"wrote {args.output}", file=sys.stderr)
    _print_diags(c.diagnostics, sources, "text")
    return 0 if c.ok else 1


def cmd_run(args) -> int:
    from streamsched.interp.train import TaskFailedError, TrainOptions, train

    t_command = time.perf_counter()
    sources = SourceCache()
    try:
        c = _compile(args, sources, args.file)
        if not c.ok:
            _print_diags(c.diagnostics, sources, "text")
            return 1
        _print_diags([d for d in c.diagnostics if d.severity == "warning"], sources, "text")
        devices = 1 if args.devices is None else args.devices
        if devices < 1:
            raise StreamschedError([Diagnostic("X004", f"--devices must be at least 1, got {devices}",
                                               help="e.g. `--devices 2`")])
        if devices > 1:
            from streamsched.interp.cuda import cuda_available
            from streamsched.interp.distributed import launch_or_simulate

            code = launch_or_simulate(args.backend, devices, tuple(args.argv), cuda_available)
            if code is not None:
                return code
        opts = TrainOptions(epochs=args.epochs, lr=args.lr, seed=args.seed, backend=args.backend,
                            interleave=args.interleave, interleave_seed=args.interleave_seed, log=args.log,
                            save=args.save, resume=args.resume, resume_weights=args.resume_weights,
                            overwrite=args.overwrite,
                            data_on=args.data_on, epoch_launch=args.epoch_launch,
                            max_steps=args.steps, progress=not args.quiet, threads=args.threads,
                            data_limit=args.data_limit, protect=_includes(sources, args.file),
                            argv=tuple(args.argv), devices=devices)
        t_train = time.perf_counter()
        res = train(c, opts, base_dir=os.path.dirname(os.path.abspath(args.file)))
    except TaskFailedError as e:
        t = e.task
        _print_diags([Diagnostic("X011", f"task `{t.label or t.kernel}` on {t.stream} failed: {e.cause}", t.span,
                                 help="this is a run-time failure of a kernel; the line is where the work was written")],
                     sources, "text")
        return 1
    except StreamschedError as e:
        _print_diags(e.diagnostics, sources, "text")
        return 1
    for r in res.races:
        _print_diags([r], sources, "text")
    last = res.history[-1] if res.history else {}
    acc = last.get("test_acc")
    if res.steps == 0:  # no timing or loss to speak of
        msg = f"no steps run ({res.note or 'nothing to do'})"
        if acc is not None:
            msg += f"; last recorded: epoch {last.get('epoch')}, test accuracy {100 * acc:.2f}%"
        print(msg)
        return 1 if res.races else 0
    us = 1e6 * res.wall_s / max(res.steps, 1)
    first = (t_train - t_command) + res.first_step_s  # parse, check, data, backend, capture, compile
    msg = (f"{res.backend}: {res.steps} steps in {res.wall_s:.2f} s ({us:.0f} us/step wall, eval included; "
           f"training {res.steady_us_per_step:.0f} us/step, evaluation {res.eval_s:.2f} s; first step "
           f"{first:.2f} s after the command); "
           f"epoch {last.get('epoch')}{_partial(last)}: train loss {last.get('train_loss', float('nan')):.4f}")
    if acc is not None:
        msg += f", test loss {last.get('test_loss'):.4f}, test accuracy {100 * acc:.2f}%"
    print(msg)
    for note in res.notes:
        print(f"note: {note}", file=sys.stderr)
    return 1 if res.races else 0


def _partial(rec: dict) -> str:
    """` (partial: 4 of 11 steps)` for the record of an epoch that `--steps` cut short."""
    if rec.get("partial"):
        return f" (partial: {rec.get('epoch_steps')} of {rec.get('steps_per_epoch')} steps)"
    return ""


def cmd_trace(args) -> int:
    sources = SourceCache()
    c = _compiled_or_report(args, sources)
    if c is None:
        return 1
    if not c.ok:
        _print_diags(c.diagnostics, sources, "text")
        return 1
    from streamsched.outputs import replaced

    try:
        out, png = _outputs(c, sources, [(args.output, "trace", "the trace", "-o"),
                                         (args.png, "picture", "the timeline", "--png")])
    except StreamschedError as e:
        _print_diags(e.diagnostics, sources, "text")
        return 1
    from streamsched.interp.cuda import cuda_available

    ok, why = cuda_available()
    if not ok:
        print(f"error[X020]: `streamsched trace` times tasks on the GPU: {why}", file=sys.stderr)
        return 1
    from streamsched.interp.cuda.trace import trace

    try:
        with replaced(out) as tmp_json:
            if png is not None:
                with replaced(png) as tmp_png:
                    trace(c, tmp_json, png=tmp_png, steps=args.steps)
            else:
                trace(c, tmp_json, png=None, steps=args.steps)
    except OSError as exc:
        print(f"error[X021]: cannot write `{args.output}`: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}" + (f" and {args.png}" if args.png else ""), file=sys.stderr)
    return 0


def _argument_parser(argparse):
    class ArgumentParser(argparse.ArgumentParser):
        """argparse with the project's rule for user mistakes: a bad command line (unknown option,
        missing argument, `--epochs five`) prints the usage and an X004 diagnostic and exits 1, not
        argparse's 2.  Subcommand parsers inherit it (add_subparsers uses the parent's class)."""

        def __init__(self, *a, **kw):
            kw.setdefault("allow_abbrev", False)  # `--res` is not `--resume`: the resume command is exact
            super().__init__(*a, **kw)

        def error(self, message: str):  # noqa: D102 (argparse's hook)
            self.print_usage(sys.stderr)
            self.exit(1, f"error[X004]: {message}\n  = help: `{self.prog} --help` lists the options\n")

    return ArgumentParser


def build_parser() -> "argparse.ArgumentParser":
    _load()
    p = ArgumentParser(prog="streamsched", description="Check, plan and run multi-stream training schedules.")
    p.add_argument("--version", action="version", version=f"streamsched {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    pol = dict(choices=["auto", "chain", "explicit"], default=None, help="barrier policy (overrides the file)")
    cap = dict(choices=["none", "graphs", "step"], default=None, help="capture mode (overrides the file)")
    kern = dict(action="append", default=[], metavar="MODULE",
                help="import kernels written in Python from MODULE (package.module, or an entry point of "
                     "streamsched.kernels); may be repeated")

    nofuse = dict(action="store_true", help="plan every task as written (no fusion: no multi-tensor launches, "
                                            "fused cross-entropy or GEMM epilogues), for comparison")

    c = sub.add_parser("check", help="parse, resolve and prove a schedule race-free")
    c.add_argument("files", nargs="+")
    c.add_argument("--format", choices=["text", "json"], default="text")
    c.add_argument("--policy", **pol)
    c.add_argument("--capture", **cap)
    c.add_argument("--kernels", **kern)
    c.add_argument("--no-fuse", **nofuse)
    c.set_defaults(fn=cmd_check)

    lo = sub.add_parser("lower", help="print the event plan (per-stream launch / record / wait)")
    lo.add_argument("file")
    lo.add_argument("--policy", **pol)
    lo.add_argument("--capture", **cap)
    lo.add_argument("--kernels", **kern)
    lo.add_argument("--no-fuse", **nofuse)
    lo.add_argument("-o", "--output")
    lo.set_defaults(fn=cmd_lower)

    g = sub.add_parser("graph", help="draw the task DAG, one lane per stream (.dot, .svg, .png)")
    g.add_argument("file")
    g.add_argument("-o", "--output", required=True)
    g.add_argument("--policy", **pol)
    g.add_argument("--capture", **cap)
    g.add_argument("--kernels", **kern)
    g.add_argument("--no-fuse", **nofuse)
    g.add_argument("--captured", action="store_true", help="draw the CUDA graph as captured (needs a GPU)")
    g.set_defaults(fn=cmd_graph)

    t = sub.add_parser("trace", help="time every task on the GPU: a Chrome/Perfetto trace, one track per stream")
    t.add_argument("file")
    t.add_argument("-o", "--output", required=True, help="trace.json")
    t.add_argument("--png", help="also draw the timeline (matplotlib)")
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--policy", **pol)
    t.add_argument("--capture", **cap)
    t.add_argument("--kernels", **kern)
    t.add_argument("--no-fuse", **nofuse)
    t.set_defaults(fn=cmd_trace)

    r = sub.add_parser("run", help="train: the main job")
    r.add_argument("file")
    r.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    r.add_argument("--policy", **pol)
    r.add_argument("--capture", **cap)
    r.add_argument("--kernels", **kern)
    r.add_argument("--no-fuse", **nofuse)
    r.add_argument("--epochs", type=int)
    r.add_argument("--steps", type=int, help="stop after this many steps")
    r.add_argument("--lr", type=float, help="constant learning rate (overrides the schedule)")
    r.add_argument("--seed", type=int)
    r.add_argument("--interleave", choices=["fixed", "random"], default="fixed",
                   help="CPU backend: stream interleaving")
    r.add_argument("--interleave-seed", type=int, default=0)
    r.add_argument("--data-on", choices=["auto", "host", "device"], default="auto",
                   help="where the training set lives on the CUDA backend: device (uploaded once, each batch "
                        "gathered on the GPU, no host work per step), host (staged every step), auto (device when "
                        "it fits a quarter of the free GPU memory)")
    r.add_argument("--epoch-launch", type=_epoch_launch, default="auto", metavar="{auto,epoch,step,N}",
                   help="CUDA backend with device-resident data: auto runs whole epochs as launches of the epoch "
                        "graph (the captured steps and each epoch's end in CUDA conditional nodes, CUDA 12.4+), "
                        "several epochs per launch (about 256 steps, at most 16 epochs); epoch one epoch per "
                        "launch; N at most N epochs per launch (16 at most); step launches the steps one by one")
    r.add_argument("--devices", type=int, metavar="N",
                   help="data parallel over N ranks: one process per GPU on this machine (NCCL_NVLS_ENABLE=0 in "
                        "each), or N ranks simulated in this process on the CPU backend")
    r.add_argument("--log", help="append one JSON line per epoch (only to a log streamsched wrote)")
    r.add_argument("--save", help="checkpoint file (.npz, written atomically each epoch; replaces an existing "
                                  "checkpoint only when this run continues it with --resume, or with --overwrite)")
    r.add_argument("--overwrite", action="store_true",
                   help="let --save replace a checkpoint streamsched wrote that this run does not continue")
    r.add_argument("--resume", help="continue from a checkpoint (any change that keeps every array's name, "
                                    "shape and dtype; the changes are listed)")
    r.add_argument("--resume-weights", metavar="CHECKPOINT",
                   help="start a new run from a checkpoint's parameters (fine-tuning)")
    r.add_argument("--threads", type=int, help="BLAS threads (default: one, or more for matrix products large "
                                               "enough to use them, at most the cores this process may use; more "
                                               "threads on small products are much slower on a busy machine)")
    r.add_argument("--data-limit", type=_size, metavar="SIZE",
                   help="the most bytes data files and checkpoints may hold, e.g. 16G "
                        "(default 4G, or $STREAMSCHED_DATA_LIMIT)")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no per-epoch lines")
    r.set_defaults(fn=cmd_run)
    return p


def _epoch_launch(text: str) -> str:
    """`--epoch-launch`: auto, epoch, step, or a whole number of epochs per launch (1 or more)."""
    from streamsched.interp.training.settings import epoch_launch_error

    why = epoch_launch_error(text)
    if why:
        raise argparse.ArgumentTypeError(why)
    return text.lstrip("0") if text.isdigit() else text


def _size(text: str) -> int:
    from streamsched.reads import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Feedback:
    """A command's sys.stdout or sys.stderr: a write or flush that fails (a reader that stopped
    reading, a stream closed, a full disk) is dropped rather than raised, so that feedback never
    stops the work, and every later one is dropped too; `error` keeps the first failure for
    `main` to report.  After a failure the descriptor is pointed at /dev/null, so the
    interpreter's last flush at exit does not fail again (the recipe of Python's `signal`
    documentation for SIGPIPE).  Everything else is the wrapped stream's."""

    def __init__(self, raw, name: str):
        self._raw = raw
        self.name = name
        self.error: BaseException | None = None

    def write(self, text: str) -> int:
        if self.error is None:
            try:
                return self._raw.write(text)
            except (OSError, ValueError) as e:
                self._failed(e)
        return len(text)

    def flush(self) -> None:
        if self.error is None:
            try:
                self._raw.flush()
            except (OSError, ValueError) as e:
                self._failed(e)

    def isatty(self) -> bool:
        try:
            return self.error is None and self._raw.isatty()
        except (OSError, ValueError, AttributeError):
            return False

    def _failed(self, e: BaseException) -> None:
        self.error = e
        try:
            fd = self._raw.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no descriptor (captured in tests)
            pass

    @property
    def lost(self) -> bool:
        """Whether writing failed for a reason the user did not choose: not a reader that stopped
        reading (EPIPE), not a stream they closed (EBADF, a closed file)."""
        e = self.error
        if e is None or isinstance(e, (BrokenPipeError, ValueError)):
            return False
        return getattr(e, "errno", None) not in (errno.EPIPE, errno.EBADF)

    def __getattr__(self, name):
        return getattr(self._raw, name)


def _streams() -> tuple[_Feedback, _Feedback, tuple]:
    """Wrap sys.stdout and sys.stderr in `_Feedback` (returns them and the originals).  A standard
    descriptor that is closed (`>&-`) is first pointed at /dev/null, so that no file the command
    opens gets descriptor 0, 1 or 2 (a child process such as `dot`, or any C code, writing to
    "stdout" would write into the checkpoint or log), and the stream writes nowhere: the user
    closed it to discard it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            try:
                n = os.open(os.devnull, os.O_RDWR)
                if n != fd:
                    os.dup2(n, fd)
                    os.close(n)
            except OSError:  # pragma: no cover
                pass
    orig = (sys.stdout, sys.stderr)
    out = sys.stdout if sys.stdout is not None else open(os.devnull, "w", encoding="utf-8")
    err = sys.stderr if sys.stderr is not None else open(os.devnull, "w", encoding="utf-8")
    sys.stdout, sys.stderr = _Feedback(out, "standard output"), _Feedback(err, "standard error")
    return sys.stdout, sys.stderr, orig


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (the terminal went away), turned into an interrupt so that a run ends as
    on Ctrl-C: its log closed, its locks released, the resume command printed (where it can be)."""

    def __init__(self, signum: int | None = None):
        super().__init__()
        self.signum = int(signal.SIGTERM if signum is None else signum)


def _on_signal(signum, frame):
    note_caught(signum)  # should the interrupt be swallowed (raised inside a __del__), the loop still ends
    raise Terminated(signum)


def _on_sigint(signum, frame):
    note_caught(signum)
    signal.default_int_handler(signum, frame)


def _install_signals() -> dict:
    """Handle SIGTERM and SIGHUP as interrupts, unless they are ignored (`nohup` ignores SIGHUP:
    that choice is kept).  Returns the previous handlers, for `main` to restore."""
    old = {}
    clear_caught()
    for sig in (s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None):
        try:
            if signal.getsignal(sig) != signal.SIG_IGN:
                old[sig] = signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main thread
            pass
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # Ctrl-C: Python's own, noted
            old[signal.SIGINT] = signal.signal(signal.SIGINT, _on_sigint)
    except (ValueError, OSError):
        pass
    return old


def _interrupted(e: BaseException) -> int:
    """The end of a command stopped by a signal: what the run said (TrainInterrupted's lines),
    else one line; status 128 + the signal.  A second Ctrl-C from here on ends the process at
    once (the default action), without a traceback."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    except (ValueError, OSError):
        pass
    # An interrupt that landed in code run by exec() of a string (namedtuple and dataclass build
    # their methods so, during imports) leaves CPython's "unhandled KeyboardInterrupt" flag set, and
    # the interpreter would then kill itself with SIGINT at exit although the interrupt was handled
    # here; every exec() of a string starts by clearing that flag.
    exec("None")  # noqa: S102
    signum = int(getattr(e, "signum", signal.SIGINT))
    lines = getattr(e, "lines", None)
    if not lines:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        lines = [f"interrupted by {name}"]
    print("\n".join(lines), file=sys.stderr)
    return 128 + signum


_PATH_OPTIONS = (("save", "--save"), ("log", "--log"), ("resume", "--resume"), ("resume_weights", "--resume-weights"),
                 ("output", "-o"), ("png", "--png"))


def _empty_path(args) -> Diagnostic | None:
    """X004 for an option that names a file given an empty name (`--save "$CKPT"` with CKPT
    unset would otherwise run without the checkpoint, or start afresh instead of resuming)."""
    for attr, flag in _PATH_OPTIONS:
        if getattr(args, attr, None) == "":
            return Diagnostic("X004", f"{flag} needs a file name, got an empty one (an unset shell variable?)",
                              help=f"give {flag} a file name, e.g. `{flag} run.npz`" if attr in ("save", "resume",
                                   "resume_weights") else f"give {flag} a file name, or leave the option out")
    return None


def main(argv: list[str] | None = None) -> int:
    """The command line `argv` (default sys.argv[1:]); returns the exit status (module
    docstring).  Never raises, an interrupt at any moment included."""
    out = err = None
    orig = None
    old = {}
    try:
        _load()
        out, err, orig = _streams()
        old = _install_signals()
        rc = _main(argv)
        out.flush()
        err.flush()
        if out.lost:
            rc = max(rc, 1)
            e = out.error
            print(f"error[X021]: cannot write the standard output: {getattr(e, 'strerror', None) or e}\n"
                  "  = help: free space, or send the output elsewhere", file=sys.stderr)
        if err.lost:
            rc = max(rc, 1)
            e = err.error
            print(f"error[X021]: cannot write the standard error: {getattr(e, 'strerror', None) or e}; "
                  "messages of this command were lost", file=sys.stdout)
        return rc
    except KeyboardInterrupt as e:  # (TrainInterrupted is one) at any moment, imports included
        _load()
        return _interrupted(e)
    finally:
        for sig, h in old.items():
            try:
                signal.signal(sig, h)
            except (ValueError, OSError, TypeError):
                pass
        if "clear_caught" in globals():
            clear_caught()
        if orig is not None:
            for f in (out, err):
                try:
                    f.flush()
                except BaseException:  # noqa: BLE001  (nothing may escape here)
                    pass
            sys.stdout, sys.stderr = orig


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error (X004): argparse printed it
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    args.argv = argv
    bad = _empty_path(args)
    if bad is not None:
        _print_diags([bad], SourceCache(), "text")
        return 1
    try:
        return args.fn(args)
    except InternalError as exc:
        print(f"internal error (a bug in streamsched, not in your file): {exc}", file=sys.stderr)
        traceback.print_exc()
        return 3
