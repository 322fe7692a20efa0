"""The training loop driven by the `train` block (`train`): settings, outputs and their locks
checked before any work, then `Run`: the EventPlan issued one step at a time on a backend, the
losses read once per epoch, evaluation each epoch, JSON-lines logs, atomic checkpoints, and a
clear stop on divergence or an interrupt.

Source: LANGUAGE.md (`train`, `step`), the seed's run_train_epoch_gpu step loop.
"""

from __future__ import annotations

import functools
from collections import deque
import math
import signal
import sys
import time
from dataclasses import replace
from typing import Any, Callable

from streamsched.diagnostics import Diagnostic, StreamschedError
from streamsched.dsl.resolve import CallValue
from streamsched.interp.barriers import plan_segments
from streamsched.interp.checkpoint import first_nonfinite
from streamsched.interp.cpu_threads import blas_threads, choose_threads
from streamsched.interp.distributed import dp_main, dp_place
from streamsched.interp.ir import Task
from streamsched.interp.lr import make_schedule
from streamsched.interp.resume import changes, lr_meta, resume_command, schedule_from_meta
from streamsched.interp.training.checkpoints import Checkpoints
from streamsched.interp.training.data_path import DataPath
from streamsched.interp.training.divergence import divergence
from streamsched.interp.training.evaluation import make_evaluator
from streamsched.interp.training.losses import EpochLosses
from streamsched.interp.training.options import (MAX_EPOCHS_PER_LAUNCH, STEPS_PER_LAUNCH, TrainInterrupted,
                                                 TrainOptions, TrainResult, _stderr_line, _x)
from streamsched.interp.training.run_log import RunLog
from streamsched.interp.training.runners import make_runner
from streamsched.interp.training.settings import (_call, _layout_json, _log_output, _run_inputs, init_params,
                                                  run_settings, setting_dir)
from streamsched.interp.training.signals import _quiet_numpy, _signals_deferred, raise_if_swallowed
from streamsched.outputs import (Output, OutputLock, check_distinct, check_output, holder_info, new_run_id,
                                 remove_stale_temps)
from streamsched.pipeline import Compiled
from streamsched.stdlib.kernels import numpy_dtype


def train(compiled: Compiled, opts: TrainOptions | None = None, *, base_dir: str = ".",
          echo: Callable[[str], None] | None = None) -> TrainResult:
    """Run the training loop of a compiled program; returns the history and final parameters.

    Before any work: the settings, then every output (outputs.check_output: `--save`, the log;
    none is an input of the run, a file streamsched did not write as that output, a checkpoint
    this run does not continue (unless overwrite), read-only, or the other output), then their
    locks (X009 when another run holds one; the log through its inode too), then the checkpoint
    to resume from (X007, X014), then the data (bounded, finite, X003).  Each epoch's checkpoint
    and log line are written together, after the outputs are checked again (X021 for a file put
    there during the run).  Raises StreamschedError (X codes) for bad data, options, outputs and
    checkpoints and for a diverging run (X010: the loss or the state became NaN or infinite, or
    the epoch broke the divergence rule; no checkpoint of that epoch is written, the last one is
    named); TrainInterrupted on SIGINT, SIGTERM or SIGHUP (as the CLI maps them), at any point.
    Feedback lines go to `echo` (default: stderr, where a failed write loses the line, never the
    run).
    """
    opts = opts or TrainOptions()
    echo = echo or _stderr_line
    program = compiled.program
    if program.model is None:
        raise _x("X004", "the file has no model to train")
    if compiled.plan is None or not compiled.ok:
        raise StreamschedError(list(compiled.diagnostics) or [Diagnostic("X004", "the schedule does not check")])
    m = program.model
    if not program.step:
        raise _x("X012", "nothing to run: the file has no `step` block",
                 help="add the step, e.g. `step train(slot) { upload lr on trans; zero_grad; pass(load[slot]); "
                      "load[next]; optimize }` (see examples/mlp_digits.sched)")
    written = {o for t in compiled.schedule.tasks for o in t.outs}
    if m.loss not in written:
        raise _x("X012", f"the step never computes the loss of model `{m.name}`",
                 help=f"launch a graph that runs `forward {m.name}; backward {m.name}`")
    stale = [p for p in m.params if not any(p in t.outs for t in compiled.schedule.tasks)]
    if stale and len(stale) == len(m.params):
        raise _x("X012", f"the step never updates the parameters of model `{m.name}`",
                 help=f"launch a graph that calls an optimizer, e.g. `sgd({m.name}, lr, momentum = 0.9)`")
    tv = dict(program.train)
    spans = dict(program.train_spans)
    # Settings first, every output second, the data last: a mistake stops the run before any work.
    seed, epochs = run_settings(program, opts)
    data = _call(tv.get("data", CallValue("digits", (), ())), "digits")
    data_base = setting_dir(spans.get("data"), base_dir)
    inputs = _run_inputs(program, opts, data, data_base)
    layout = _layout_json(program)
    save = check_output(opts.save, "checkpoint", noun="the checkpoint", origin="--save", inputs=inputs,
                        replaceable=(opts.resume,), overwrite=opts.overwrite,
                        fits=lambda meta: meta.get("layout", layout) == layout) if opts.save is not None else None
    log = _log_output(tv, spans, opts.log, base_dir, inputs)
    if not dp_main():  # a data-parallel rank other than 0: rank 0 writes the log and the checkpoints
        save, log, opts = None, None, replace(opts, progress=False)
    check_distinct([save, log])
    run_id = new_run_id()
    holder = holder_info(run_id, ["streamsched", *opts.argv] if opts.argv else None)
    locks: list[OutputLock] = []
    try:
        for out in (save, log):
            if out is not None:
                lock = OutputLock(out, holder)
                lock.acquire()
                locks.append(lock)
                if out is log:  # appended in place: its inode is the file, whatever its name (hard links)
                    lock.hold_file()
        if save is not None:
            gone = remove_stale_temps(save.full)
            if gone:
                echo(f"note: removed {len(gone)} temporary file{'s' if len(gone) != 1 else ''} that a killed run "
                     f"left next to `{save.path}`: {', '.join(gone)}")
        run = Run(compiled, opts, echo, run_id, seed, epochs, data, data_base, save, log)
        if run.runlog is not None:
            run.runlog.lock = next((lk for lk in locks if lk.out is log), None)
        return run.go()
    finally:
        for lock in reversed(locks):
            lock.release()


class Run:
    """One training run once its settings and outputs are checked and locked: the step loop and
    its bookkeeping (records, divergence, what a stop reports), over parts with one job each:
    `dp` (data_path.DataPath: the data and its staging), `runner` (the backend), `evaluator`
    (evaluation.make_evaluator), `ck` (checkpoints.Checkpoints), `runlog` (run_log.RunLog),
    `progress` (Progress: the bar and the feedback lines).  The step loop itself stays a few
    lines (`loop`); what happens after each step is `after_step`, after each epoch `end_epoch`."""

    def __init__(self, compiled: Compiled, opts: TrainOptions, echo, run_id: str, seed: int, epochs: int,
                 data: tuple, data_base: str, save: Output | None, log: Output | None):
        self.c, self.opts, self.echo, self.run_id = compiled, opts, echo, run_id
        self.program, self.m = compiled.program, compiled.program.model
        self.seed, self.epochs, self.data, self.data_base = seed, epochs, data, data_base
        self.log = log
        self.ck = Checkpoints(self.program, opts, run_id, save)
        self.dp: DataPath | None = None
        self.spans = dict(self.program.train_spans)
        self.result = TrainResult(run_id=run_id)
        self.steps_run = 0
        self.epoch_now = 0  # the epoch (from 1) in progress
        self.losses: list[float] = []
        self.progress = Progress(opts.progress, echo)
        self.runlog = RunLog(log, echo, self.ck.kept) if log is not None else None
        self.done_epoch = 0  # the last whole epoch (from 1) this run finished
        self.start_epoch = 0
        self.t0 = time.perf_counter()
        self.best: float | None = None  # the lowest train loss of the whole epochs so far (the baseline)
        self.best_acc: float | None = None  # the highest test accuracy of the whole epochs so far
        self._host_tasks: dict[tuple, Any] = {}  # (task id, id of its arrays) -> `_host_task`

    # ---- setup

    def lr_request(self) -> tuple[str, tuple, dict, Any]:
        if self.opts.lr is not None:
            return "constant", (self.opts.lr,), {}, None
        lname, largs, lkw = _call(dict(self.program.train).get("lr", 0.1), "constant")
        return lname, largs, lkw, self.spans.get("lr")

    def plan_lr(self, total: int) -> None:
        """The learning-rate schedule over absolute steps 0..total-1: the file's (or --lr), with a
        warmup longer than the run clipped (a note says so); when resuming with the very schedule
        the checkpoint was planned with, that plan continued by absolute step."""
        lname, largs, lkw, span = self.lr_request()
        sched = make_schedule(lname, largs, lkw, total, span, clip_warmup=True)
        self.lr_continues = False
        self.lr_requested = (f"--lr {self.opts.lr:g}" if self.opts.lr is not None else
                             str(make_schedule(lname, largs, lkw, 10 ** 12, span, check_range=False)))
        if self.ck.resumed is not None:
            old = schedule_from_meta(self.ck.resumed.meta.get("lr"))
            same = isinstance(self.ck.resumed.meta.get("lr"), dict) and \
                self.ck.resumed.meta["lr"].get("requested") == self.lr_requested
            if old is not None and same:
                sched = old.continued(self.ck.resumed.step, total)
                self.lr_continues = total != old.total_steps
                self.lr_planned = old
        if sched.warmup_clipped_from is not None and not (self.ck.resumed and sched.resume):
            self.echo(f"note: the warmup of {sched.warmup_clipped_from} steps is longer than this run "
                      f"({total} steps); it is clipped to {total} steps")
        self.lr_sched = sched

    def start(self, runner) -> None:
        """Initial values, then the checkpoint: --resume (every array, where the run stopped) or
        --resume-weights (the parameters only)."""
        program, opts = self.program, self.opts
        state = init_params(program, self.seed)
        if self.ck.resumed is not None:
            state.update(self.ck.resumed.arrays)
            self.result.history = list(self.ck.resumed.history)
        elif self.ck.weights is not None:
            params, meta = self.ck.weights
            state.update(params)
            bufs = {b.name: b for b in program.buffers}
            for name, init in program.inits:  # EMA and f32 masters start at the loaded parameter
                if init.startswith("copy:") and init[5:] in params:
                    state[name] = params[init[5:]].astype(numpy_dtype(bufs[name].dtype))
            self.echo(f"note: loaded the {len(params)} parameter{'s' if len(params) != 1 else ''} of `{self.m.name}` "
                      f"from `{opts.resume_weights}`" + (f" (epoch {meta['epoch']} of run {meta['run']})"
                                                         if meta.get("run") and meta.get("format", 1) >= 2 else "")
                      + "; the optimizer state, statistics and epoch count start afresh")
        for name, v in state.items():
            runner.write(name, v)

    def resume_notes(self, total: int) -> None:
        r = self.ck.resumed
        now = {"program": self.program.text_hash, "model": self.m.name, "data": self.ds.name, "seed": self.seed,
               "epochs": self.epochs, "steps_per_epoch": self.spe, "lr": self.lr_requested}
        changed = changes(r.meta, now)
        msg = f"resumed from `{r.path}` after epoch {r.epochs_done} (step {r.step})"
        if changed:
            msg += "; changed since it was written: " + ", ".join(changed)
        self.echo(msg)
        s = self.lr_sched
        if self.lr_continues and self.start_epoch < self.epochs:
            old = self.lr_planned
            end = s(total)
            if s.restarted:
                self.echo(f"note: the learning-rate plan of `{r.path}` had ended at step {old.total_steps} (rate "
                          f"{old(old.total_steps):.6g}), where going on would train at {end:.6g}; the {total - r.step} "
                          f"new steps follow {s} stretched to the new end, step {total}: {s(r.step):.6g} at step "
                          f"{r.step}, decaying to {end:.6g} (docs/data.md, \"Learning-rate schedules\")")
            else:
                start = s(r.step)
                how = (f"decays to {end:.6g} at" if end < start else f"rises to {end:.6g} at" if end > start
                       else "stays there until")  # a constant rate neither decays nor rises
                self.echo(f"note: the learning rate continues the plan of `{r.path}` from step {r.step} "
                          f"({start:.6g}) and {how} step {total}, the end of this run (the plan "
                          f"ended at step {old.total_steps})")
        if self.start_epoch >= self.epochs:
            self.result.note = (f"the checkpoint `{r.path}` already holds all {self.epochs} epoch"
                                f"{'s' if self.epochs != 1 else ''}; give a larger --epochs to train further")

    # ---- the loop

    def go(self) -> TrainResult:
        """The run, from its checkpoints and data to its last epoch.  An interrupt at any point
        (loading the data included) is TrainInterrupted with what the outputs hold."""
        try:
            try:
                self.prepare()
                if self.runlog is not None:
                    self.runlog.open()
                self.t0 = time.perf_counter()
                self.progress.open(self.local_total)
                opts, runner, threads = self.opts, self.runner, self.result.threads
                if opts.progress and self.local_total:
                    ranks = f", {self.world} ranks of batch {self.m.batch}" if self.world > 1 else ""
                    self.say(f"run {self.run_id}: model `{self.m.name}` on {runner.name} ({threads} BLAS thread"
                             f"{'s' if threads != 1 else ''}{ranks}), epochs {self.start_epoch + 1}-{self.epochs} of "
                             f"{self.spe} steps")
                with blas_threads(threads), _quiet_numpy():
                    self.loop(runner)
                self.close(report=True)
            finally:
                self.close()
        except KeyboardInterrupt as exc:
            signum = getattr(exc, "signum", signal.SIGINT)
            raise TrainInterrupted(signum, self.interrupted_lines(signum)) from None
        runner.sync()
        self.result.params = {n: runner.read(n) for n in self.ck.saved}
        self.result.steps = self.steps_run
        self.steps_note()
        self.result.wall_s = time.perf_counter() - self.t0
        self.result.races = runner.races
        return self.result

    def prepare(self) -> None:
        """Everything before the first step: the checkpoints, the data, the backend, the initial
        values, the learning-rate plan, the notes."""
        opts = self.opts
        self.t_start = time.perf_counter()
        self.ck.load()
        self.rank, self.world = dp_place(opts)
        self.check_ranks_reduce()
        dp = self.dp = DataPath(self.program, self.data, self.data_base, self.spans, self.seed, opts.data_limit,
                                world=self.world, rank=self.rank)
        self.ds, self.spe, self.classes = dp.ds, dp.spe, dp.classes
        self.start_epoch = self.ck.resumed.epochs_done if self.ck.resumed else 0
        self.base_step = self.ck.resumed.step if self.ck.resumed else 0  # absolute steps before this run
        self.local_total = max(0, self.epochs - self.start_epoch) * dp.spe
        dp.plan(self.start_epoch, self.epochs)
        notes: list[str] = []
        runner = make_runner(self.c, opts, data=dp, steps=self.local_total, notes=notes)
        for line in notes:
            self.echo(f"note: {line}")
        self.runner = runner
        self.result.backend = runner.name
        self.resident = getattr(runner, "resident", None)
        self.result.data_on = "device" if self.resident is not None else "host"
        threads, note = choose_threads(opts.threads, self.c.schedule)
        self.result.threads = threads
        if note:
            self.echo(f"note: {note}")
        self.start(runner)
        spe = self.spe
        total = self.base_step + max(0, self.epochs - self.start_epoch) * spe  # the run's end, absolute
        self.plan_lr(max(total, 1))
        if self.ck.resumed:
            self.resume_notes(total)
        if opts.max_steps == 0 and not self.result.note:
            self.result.note = "--steps 0"
        if self.resident is not None:  # the per-step scalars as host_fn would write them, the first two epochs
            base = self.base_step
            self.resident.fill_scalars(lambda name, j: self.lr_sched(base + j) if name == "lr" else float(base + j + 1))
            for e in range(self.resident.halves if self.resident.halves > 2 else 2):  # every epoch's, or two
                self.upload_order(e)
        self.evaluator = make_evaluator(runner, self.program, self.ds.x_test, self.ds.y_test, self.ck.saved,
                                        self.echo)
        self.result.eval_on = self.evaluator.where
        setup = getattr(runner, "setup_epoch_ends", None)
        if setup is not None:  # the CUDA backend: epoch ends on the device, read later
            saved = list(self.ck.saved)
            setup(saved, saved, [self.program.loss_scale] if self.program.loss_scale else [], self.evaluator)
        self.done_epoch = self.start_epoch
        self.baseline()

    def loop(self, runner) -> None:
        """The epochs: each one's steps issued one by one, then its end issued without waiting
        (`issue_end`), or several whole epochs issued as one launch of the epoch graph (steps
        and ends, `launch_plan`); an end is read (`finish`) as soon as the device has got
        there (polled after each step), at the latest after the next launch was issued, so the
        device never idles at an epoch's end (a lag of at most one launch; on the CPU every
        end is ready at once: read before the next epoch starts)."""
        opts, spe = self.opts, self.spe
        segs = self.c.segments or plan_segments(self.c.plan)
        self.cur = -1  # the step (of this run, from 0) whose host work runs
        self.pending: deque = deque()  # (epoch, its first step, its end, evaluated), oldest first
        prep = getattr(runner, "prepare_ends", None)
        if prep is not None:  # the ends (ring ends) captured before the first step
            for line in prep([self.wants_eval(e, True) for e in range(self.start_epoch, self.epochs)] + [True]):
                self.echo(f"note: {line}")
        graph = self.epoch_graph(runner, segs)  # before any step: its captures reset the gathers
        self.result.first_step_s = time.perf_counter() - self.t_start
        runner.run(segs.for_step(-1), functools.partial(self.host_fn, step=-1))
        steady = None
        e = self.start_epoch
        while e < self.epochs:
            if opts.max_steps is not None and self.steps_run >= opts.max_steps:
                break  # (before any work: `--steps 0` runs, records and saves nothing)
            self.epoch_now, self.epoch_t0 = e + 1, time.perf_counter()
            if steady is None and e > self.start_epoch:  # the steady state: every epoch but the first
                steady = (self.epoch_t0, time.process_time(), self.steps_run, self.result.eval_s, time.thread_time())
            first = self.steps_run  # steps of this run before this epoch
            n = spe if opts.max_steps is None else min(spe, opts.max_steps - self.steps_run)
            whole = n == spe
            launch = self.launches.get(e) if graph is not None and whole and first >= graph.start else None
            if launch is not None:
                count, evaluate, snapshot = launch
                c_issue = time.thread_time()
                ends = runner.run_epochs(count, evaluate, snapshot, self.order_after(e))
                raise_if_swallowed()
                self.result.loop_cpu_s["launch"] += time.thread_time() - c_issue
                self.steps_run += count * spe
                self.result.epoch_launches += 1
                self.progress.update(count * spe)
                issued = [(e + j, first + j * spe, end, evaluate) for j, end in enumerate(ends)]
            else:
                count = 1
                evaluate, snapshot = self.wants_eval(e, whole), self.wants_params(e, whole)
                for i in range(n):
                    k = first + i
                    self.cur = k
                    runner.run(segs.for_step(k), functools.partial(self.host_fn, step=k))
                    self.after_step(k)
                    raise_if_swallowed()  # an interrupt a __del__ swallowed ends the run all the same
                issued = [(e, first, self.issue_end(runner, evaluate, snapshot, self.order_after(e)), evaluate)]
            dt = (time.perf_counter() - self.epoch_t0) / count
            self.result.epoch_steps.extend([(n, dt)] * count)
            c_fin = time.thread_time()
            while self.pending:  # the launch before this one: read now (waiting for it if need be)
                self.finish()
            self.pending.extend(issued)
            while self.pending and self.pending[0][2].ready():
                self.finish()
            self.result.loop_cpu_s["finish"] += time.thread_time() - c_fin
            e += count
            if opts.max_steps is not None and self.steps_run >= opts.max_steps:
                break
        while self.pending:
            self.finish()
        if steady is not None and self.steps_run > steady[2]:
            t0, c0, k0, ev0, th0 = steady
            self.result.steady = (self.steps_run - k0, time.perf_counter() - t0 - (self.result.eval_s - ev0),
                                  time.process_time() - c0)
            self.result.loop_cpu_s["main_thread"] = time.thread_time() - th0

    def wants_eval(self, e: int, whole: bool) -> bool:
        return ((e + 1) % self.opts.eval_every == 0 or e == self.epochs - 1 or not whole) and self.rank == 0

    def wants_params(self, e: int, whole: bool) -> bool:
        """Whether epoch e's end needs the parameters on the host: a checkpoint, or an
        evaluation in NumPy."""
        return (self.ck.save is not None and whole) or \
            (self.wants_eval(e, whole) and getattr(self.evaluator, "where", "host") != "device")

    def order_after(self, e: int):
        """Device-resident data: the order epoch e's end uploads (this run's epoch two later),
        or None (`cuda.epoch.EpochEnds.set_order`)."""
        i = e - self.start_epoch + 2
        if self.resident is None or self.resident.halves > 2 or i >= self.epochs - self.start_epoch:
            return None  # (every epoch's order was uploaded at the start)
        return self.dp.batches.order(self.start_epoch + i)

    def issue_end(self, runner, evaluate: bool, snapshot: bool, order):
        """The end of the epoch just issued: the runner's own (`end_epoch`, read later) when it
        has one set up, else `SyncEnd` (read now: the CPU backends)."""
        if getattr(runner, "ends", None) is not None:
            return runner.end_epoch(evaluate, snapshot, order)
        return SyncEnd(runner, self.ck.saved, self.program.loss_scale)

    def epochs_per_launch(self) -> int:
        """At most this many epochs in one launch of the epoch graph: `--epoch-launch N`, 1 for
        `epoch`, else enough for about STEPS_PER_LAUNCH steps (never over
        MAX_EPOCHS_PER_LAUNCH)."""
        how = self.opts.epoch_launch
        if how == "epoch":
            return 1
        if str(how).isdigit():  # (checked: ASCII digits, at least 1; a long one is past the cap)
            return max(1, min(int(how) if len(how) <= 6 else MAX_EPOCHS_PER_LAUNCH, MAX_EPOCHS_PER_LAUNCH))
        return max(1, min(MAX_EPOCHS_PER_LAUNCH, -(-STEPS_PER_LAUNCH // max(self.spe, 1))))

    def launch_plan(self, runner, first: int) -> list[tuple[int, int, bool, bool]]:
        """The launches of the epoch graph: (epoch, epochs, evaluate, snapshot) for every whole
        epoch of this run from loop step `first` (the steady state) on.  Consecutive epochs
        share a launch when they evaluate and snapshot alike, their ends are ring ends (no
        snapshot, no order to upload: `runner.ring_ends`), up to `epochs_per_launch`."""
        spe, cap = self.spe, self.epochs_per_launch()
        maxs = self.opts.max_steps

        def fits(i: int) -> bool:
            k0 = i * spe
            return k0 >= first and (maxs is None or k0 + spe <= maxs)

        def flags(i: int) -> tuple[bool, bool]:
            e = self.start_epoch + i
            return self.wants_eval(e, True), self.wants_params(e, True)

        plan, n_local, i = [], self.epochs - self.start_epoch, 0
        while i < n_local:
            if not fits(i):
                i += 1
                continue
            ev, snap = flags(i)
            n = 1
            if runner.ring_ends(snap) and self.order_after(self.start_epoch + i) is None:
                while n < cap and i + n < n_local and fits(i + n) and flags(i + n) == (ev, snap) \
                        and self.order_after(self.start_epoch + i + n) is None:
                    n += 1
            plan.append((self.start_epoch + i, n, ev, snap))
            i += n
        return plan

    def epoch_graph(self, runner, segs):
        """The epoch in one launch (`cuda.epoch.EpochGraph`) when the run can have it: the CUDA
        backend with device-resident data, capture = step, the loss summed on the device, no
        --epoch-launch step; else None (a note says why, for a resident run).  Sets
        `self.launches` (epoch -> (epochs, evaluate, snapshot)) from `launch_plan`."""
        self.launches: dict[int, tuple[int, bool, bool]] = {}
        if getattr(runner, "ends", None) is None or self.resident is None or self.opts.epoch_launch == "step":
            return None
        spe = self.spe
        first = (segs.steps - (segs.period or 1)) if segs.period else None
        if first is None:
            self.echo("note: the epoch runs step by step: the plan has no steady state")
            return None
        plan = self.launch_plan(runner, first)
        if not plan:
            return None
        ends = [(e - self.start_epoch + n) * spe for e, n, _, _ in plan]
        keys = []
        for e, n, ev, snap in plan:
            if runner.ring_ends(snap):
                keys.append(("ring", ev))
            else:  # (its end's slot alternates with every such end: both built)
                keys += [(0, ev, snap), (1, ev, snap)]
        try:
            g = runner.epoch_graph(segs, (plan[0][0] - self.start_epoch) * spe, ends, spe)
            g.prepare(dict.fromkeys(keys))
        except NotImplementedError as exc:
            self.echo(f"note: the epoch runs step by step: {exc}")
            return None
        except Exception as exc:  # a refused capture or instantiation: the steps one by one
            self.echo(f"note: the epoch runs step by step: the epoch graph failed ({type(exc).__name__}: {exc})")
            return None
        self.launches = {e: (n, ev, snap) for e, n, ev, snap in plan}
        return g

    def finish(self) -> None:
        """Read the pending epoch's end (waiting for it if the device is not there yet), then
        its losses (X010), its record, checkpoint and log line (`end_epoch`)."""
        e, first, end, evaluate = self.pending.popleft()
        res = end.result()
        if res.acc is not None:
            total, steps, bad, value = res.acc
            losses = EpochLosses(total, steps, bad if bad >= 0 else None, value)
        else:
            losses = res.losses if getattr(res, "losses", None) is not None else EpochLosses.of(end.values)
        self.losses, self.epoch_first = losses, first
        self.epoch_now = e + 1
        self.check_losses(e)
        self.end_epoch(e, res, evaluate)

    def check_ranks_reduce(self) -> None:
        """X004 for data-parallel ranks on a step that all-reduces nothing: the replicas would
        train apart, each on its shard, and rank 0's would pass for the run's."""
        if self.world > 1 and not any(t.kernel == "allreduce_mean" or t.attr("base") == "allreduce_mean"
                                      for t in self.c.schedule.tasks):
            m = self.program.model.name if self.program.model is not None else "M"
            raise _x("X004", f"{self.world} data-parallel ranks, but the step all-reduces nothing: each rank would "
                     "train its own replica on its shard, apart from the others",
                     help=f"all-reduce the gradients before the optimizer: add `graph reduce on update "
                          f"{{ allreduce(grad({m})) }}` and launch `reduce` in the step before the optimizer "
                          "(docs/language.md, \"Data parallel\"), or run without --devices")

    def upload_order(self, e: int) -> None:
        """Device-resident data: the order of this run's epoch e (from 0), when the run has it."""
        if self.resident is not None and e < self.epochs - self.start_epoch:
            self.resident.set_epoch(e, self.dp.batches.order(self.start_epoch + e))

    def host_fn(self, task: Task, arrays: dict, step: int | None = None, rank: int | None = None) -> None:
        """Host work: batches into staging slots, scalars into pinned buffers.  step: the loop
        step that issued the task (on the CPU it may run after later steps were issued); rank:
        the data-parallel rank whose shard is staged (simulated ranks; else this process's)."""
        at = self.cur if step is None else step
        key = (task.id, id(arrays))
        fn = self._host_tasks.get(key)
        if fn is None:
            fn = self._host_tasks[key] = self._host_task(task, arrays)
        fn(at, rank)

    def _host_task(self, task: Task, arrays: dict):
        """Host task `task` writing into `arrays`, as a call (at, rank) with its attributes read
        once: a step's host work is then a few calls (issue 13: host staging keeps pace with the
        device)."""
        if task.kernel == "stage":
            return self.dp.stager(task, arrays[task.outs[0]])
        if task.kernel == "set_scalar":
            out, lr, base, sched = arrays[task.outs[0]], task.attr("name") == "lr", self.base_step, self.lr_sched

            def set_scalar(at, rank):
                k = base + (at if at > 0 else 0)  # absolute: the schedule and Adam's t go on across resumes
                out[...] = sched(k) if lr else float(k + 1)
            return set_scalar
        return lambda at, rank: None

    def after_step(self, k: int) -> None:
        """Bookkeeping after issuing step k of this run (from 0): count it, move the progress
        bar.  Nothing is read from the device here: the losses are read once per epoch."""
        self.steps_run += 1
        self.progress.update(1)
        if self.pending and self.pending[0][2].ready():  # the epoch before: read it now
            self.finish()

    def check_losses(self, e: int) -> None:
        """Stop (X010) when a step of epoch e had a loss that is not finite, naming that step."""
        el = self.losses
        if el.bad_step is not None:
            step = self.base_step + self.epoch_first + el.bad_step  # absolute, from 1
            lr_what = f" with --lr {self.opts.lr:g}" if self.opts.lr is not None else ""
            raise self.diverged(f"the loss became {el.bad_value} at step {step} (epoch {e + 1}/{self.epochs}){lr_what}")

    def baseline(self) -> None:
        """The divergence rule's baseline from the resumed history: its best train loss and test
        accuracy, when they are comparable (the same data and model; a resume onto other data
        starts a new baseline, since a loss on other data says nothing of this one's)."""
        hist = self.result.history
        if self.ck.resumed is not None:
            meta = self.ck.resumed.meta
            if meta.get("data", self.ds.name) != self.ds.name or meta.get("model", self.m.name) != self.m.name:
                hist = []

        def good(r, key):
            v = r.get(key)
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and not r.get("partial")

        self.best = min((r["train_loss"] for r in hist if good(r, "train_loss")), default=None)
        self.best_acc = max((r["test_acc"] for r in hist if good(r, "test_acc")), default=None)

    def end_epoch(self, e: int, res, evaluate: bool) -> None:
        """After epoch e (from 0), from its end's result `res` (`cuda.epoch.EpochEndResult` or
        `SyncEnd`'s): its record (evaluated on the test split when `evaluate`; `partial` when
        --steps cut it short), the divergence rule, then the checkpoint (whole epochs only) and
        the log line together, then the per-epoch line."""
        program, runner, spe = self.program, self.runner, self.spe
        losses = self.losses
        whole = len(losses) == spe
        params = res.params  # params and state (running statistics), when the end copied them
        step = self.base_step + (e - self.start_epoch) * spe + len(losses)
        rec = {"run": self.run_id, "epoch": e + 1, "step": step,
               "train_loss": losses.mean if len(losses) else float("nan"),
               "lr": self.lr_sched(max(0, min(step - 1, self.lr_sched.total_steps - 1))),
               "time_s": round(time.perf_counter() - self.t0, 3)}
        if not whole:  # --steps stopped inside it: never saved, and a resume trains it again, whole
            rec.update(partial=True, epoch_steps=len(losses), steps_per_epoch=spe)
        if program.loss_scale:  # mixed precision: the dynamic loss scale after this epoch
            rec["loss_scale"] = float(res.extra[program.loss_scale]) if program.loss_scale in res.extra \
                else float(runner.read(program.loss_scale))
        if evaluate:
            if res.eval is not None:  # evaluated on the device, inside the epoch's end
                tl, acc = res.eval
                self.result.eval_s += res.eval_s
            else:
                t_eval = time.perf_counter()
                tl, acc = self.evaluator(runner, params)
                self.result.eval_s += time.perf_counter() - t_eval
            rec.update(test_loss=tl, test_acc=acc)
            if self.ds.kind == "text":  # bytes are the tokens: the loss in bits per byte
                rec["test_bpb"] = tl / math.log(2)
        lr_what = f" with --lr {self.opts.lr:g}" if self.opts.lr is not None else ""
        why = divergence(rec["train_loss"], self.best, self.classes, rec.get("test_acc"), self.best_acc) \
            if losses else None
        bad = None
        if not why and (params is not None or res.state_bad):
            bad = first_nonfinite(params if params is not None else {n: runner.read(n) for n in self.ck.saved})
            if bad is None and res.state_bad:  # (moved on since: the device's flag is the witness)
                why = "a parameter or state array became inf or NaN while the loss stayed finite"
        if bad is not None:  # the loss stayed finite, the state did not: never saved
            name, idx, v = bad
            why = f"`{name}` became {v} at index [{', '.join(map(str, idx))}] while the loss stayed finite"
        if why:
            rec["diverged"] = True
            self.write_log(rec)
            raise self.diverged(f"training diverged in epoch {e + 1}/{self.epochs}{lr_what}: {why}", epoch=e + 1)
        self.result.history.append(rec)
        if whole:
            self.done_epoch = e + 1
            if math.isfinite(rec["train_loss"]):
                self.best = rec["train_loss"] if self.best is None else min(self.best, rec["train_loss"])
            if isinstance(rec.get("test_acc"), float) and math.isfinite(rec["test_acc"]):
                self.best_acc = rec["test_acc"] if self.best_acc is None else max(self.best_acc, rec["test_acc"])
        if (self.ck.save is not None and whole) or self.runlog is not None:
            with _signals_deferred():  # the checkpoint and its log line: both, or an interrupt before both
                if self.ck.save is not None and whole:  # only a whole epoch: a resume restarts at the next one
                    self.ck.write(e + 1, params, self.checkpoint_meta(e + 1, step),
                                  self.log.path if self.log is not None else None)
                self.write_log(rec)
        if "test_acc" in rec:
            self.progress.postfix(epoch=e + 1, loss=f"{rec['train_loss']:.4f}", acc=f"{rec['test_acc']:.3f}")
        if self.opts.progress:
            part = "" if whole else f" (partial: {len(losses)} of {spe} steps{', not saved' if self.ck.save else ''})"
            line = f"epoch {e + 1}/{self.epochs}{part}: train loss {rec['train_loss']:.4f}"
            if "test_acc" in rec:
                line += f", test loss {rec['test_loss']:.4f}, test accuracy {100 * rec['test_acc']:.2f}%"
            if "test_bpb" in rec:
                line += f", {rec['test_bpb']:.4f} bits per byte"
            self.say(line + f", {time.perf_counter() - self.epoch_t0:.2f} s")

    def diverged(self, what: str, epoch: int | None = None) -> StreamschedError:
        """X010 for a run that diverged: names the last checkpoint (and whether it is the run's best
        epoch), and the help gives the command that resumes from it with a lower learning rate (a
        tenth of --lr when the rate came from the command line; the train block's `lr` is the
        user's to lower).  A rate of 0 is never blamed (nor suggested): the weights did not move,
        so the data (caret on `data`) or the initial weights made the loss; data with features far
        beyond the usual scale gets a note either way."""
        ck = self.ck.good()
        lr = self.opts.lr
        argv = self.opts.argv
        k0 = self.base_step + getattr(self, "epoch_first", 0)
        rates = [self.lr_sched(k) for k in range(k0, k0 + max(1, len(self.losses)))]
        zero_rate = max(rates, default=0.0) == 0.0
        outlier = self.dp.outlier() if self.dp is not None else None
        notes = []
        if outlier is not None:
            v, idx = outlier
            notes.append(f"the training features reach {v:.3g} (`x_train` at [{', '.join(map(str, idx))}]); features "
                         f"that large make the loss blow up at any rate")
        if lr is not None and argv:
            argv = _without_option(argv, "--lr") + ("--lr", f"{lr / 10:g}")
        lower = "lower `lr` in the train block" if lr is None else f"use a lower rate, e.g. `--lr {lr / 10:g}`"
        where = ""
        if ck:
            rec = next((r for r in self.result.history if r.get("epoch") == ck[1] and not r.get("partial")), {})
            best = self.best_acc
            acc = rec.get("test_acc")
            if isinstance(acc, float) and best is not None and acc < best - 0.01:
                best_ep = max((r for r in self.result.history if r.get("test_acc") == best), key=lambda r: r["epoch"],
                              default={}).get("epoch")
                where = (f"; the last checkpoint is `{ck[0]}` (epoch {ck[1]}, test accuracy {100 * acc:.2f}%; the best "
                         f"epoch{f' ({best_ep})' if best_ep else ''} had {100 * best:.2f}%), no checkpoint of this "
                         "epoch was written")
            else:
                where = f"; the last good checkpoint is `{ck[0]}` (epoch {ck[1]}), no checkpoint of this epoch was written"
            lost = self.ck.lost_epochs(ck, self.done_epoch, self.start_epoch)
            if lost:
                where += f"; {lost}"
        else:
            where = "; no checkpoint was written" + (" (none was asked for: --save FILE keeps the last good epoch)"
                                                     if self.ck.save is None else "")
        if zero_rate or outlier is not None:  # the data, not the rate, is the suspect: the caret is on `data`
            dspan = self.spans.get("data")
            msg = f"{what}; stopping{where}"
            if zero_rate:
                msg += ("; the learning rate was 0, so the weights did not move: the loss comes from the data and the "
                        "initial weights, not from the rate")
            if outlier is not None:
                help_ = "scale the data: every feature should be a finite number of about [-1, 1] or [0, 1]"
                if not zero_rate:
                    help_ += f", then train again (if the data is as meant, {lower})"
            else:
                help_ = "check the data and the model's initial values (`init`)"
            return StreamschedError([Diagnostic("X010", msg, dspan, help=help_, notes=tuple(notes))])
        if ck:
            cmd = resume_command(argv, ck[0])
            if cmd:
                help_ = (f"lower `lr` in the train block, then resume from it: `{cmd}`" if lr is None else
                         f"resume from it with a tenth of the learning rate: `{cmd}`")
            else:
                help_ = f"{lower}, then resume from `{ck[0]}`"
        else:
            help_ = lower
        lr_span = None if lr is not None else self.spans.get("lr")
        return StreamschedError([Diagnostic("X010", f"{what}; stopping{where}", lr_span, help=help_,
                                            notes=tuple(notes))])

    def interrupted_lines(self, signum: int) -> list[str]:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        where = f"in epoch {self.epoch_now}/{self.epochs}" if self.epoch_now else "before the first step"
        lines = [f"interrupted by {name} {where}, after {self.steps_run} step{'s' if self.steps_run != 1 else ''} "
                 f"of this run (run {self.run_id})"]
        ck = self.ck.good()
        if ck:
            cmd = resume_command(self.opts.argv, ck[0])
            lines.append(f"the checkpoint `{ck[0]}` holds epoch {ck[1]}" + ("; resume with:" if cmd else ""))
            if cmd:
                lines.append(f"  {cmd}")
        elif self.ck.save is not None:
            lines.append(f"no epoch finished, so nothing was written to `{self.ck.save.path}`; run the same command "
                         "again" + ("" if self.opts.resume else " to start over"))
        else:
            lines.append("no checkpoint was written: give --save FILE to be able to resume")
        lost = self.ck.lost_epochs(ck, self.done_epoch, self.start_epoch)
        if lost:
            lines.append(lost[0].upper() + lost[1:] + ": they are lost")
        if self.log is not None:
            lines.append(f"the log `{self.log.path}` holds every finished epoch")
        return lines

    def steps_note(self) -> None:
        spe, save = self.spe, self.ck.save
        if save and self.steps_run > 0 and self.steps_run % spe:  # --steps stopped inside an epoch
            done = self.steps_run % spe
            stopped = self.start_epoch + self.steps_run // spe + 1  # the epoch (from 1) it stopped in
            why = (f"--steps {self.opts.max_steps} stopped after {done} of the {spe} steps of epoch {stopped}, "
                   f"and only whole epochs are saved (a resume restarts at an epoch)")
            if self.ck.saved_epoch is None:
                kept = " (the file there is untouched)" if save.exists else ""
                self.result.notes.append(f"no checkpoint was written to `{save.path}`{kept}: {why}")
            else:
                self.result.notes.append(f"the checkpoint `{save.path}` holds epoch {self.ck.saved_epoch}, not the "
                                         f"last {done} step{'s' if done != 1 else ''}: {why}")

    def say(self, line: str) -> None:
        self.progress.say(line)

    def write_log(self, rec: dict) -> None:
        if self.runlog is not None:
            self.runlog.write(rec)

    def checkpoint_meta(self, epoch: int, step: int) -> dict:
        """The metadata of the checkpoint of whole epoch `epoch` (absolute step `step`)."""
        return {"model": self.m.name, "program": self.program.text_hash, "data": self.ds.name, "seed": self.seed,
                "epoch": epoch, "epochs": self.epochs, "step": step, "steps_per_epoch": self.spe,
                "lr": lr_meta(self.lr_sched, self.lr_requested), "history": self.result.history}

    def close(self, report: bool = False) -> None:
        """Stop the staging thread, close the bar and the log; report: a failure to close the log
        (a full disk shows at the last flush) is X021, else (another error already on its way) it
        is dropped."""
        if self.dp is not None:
            self.dp.close()
        self.progress.close()
        if self.runlog is not None:
            self.runlog.close(report)


class SyncEnd:
    """An epoch's end read at once (the CPU backends, whose runner has no device-side end): the
    losses (`runner.epoch_losses()`: finishes the epoch), the saved arrays and the loss scale
    read; the same fields as `cuda.epoch.EpochEndResult`, with `losses` (EpochLosses) for acc."""

    acc = None
    eval = None
    eval_s = 0.0
    state_bad = False

    def __init__(self, runner, saved, loss_scale: str | None):
        self.losses = runner.epoch_losses()
        runner.sync()
        self.params = {n: runner.read(n) for n in saved}
        self.extra = {loss_scale: float(runner.read(loss_scale))} if loss_scale else {}
        self.values: list[float] = []

    def ready(self) -> bool:
        return True

    def result(self) -> "SyncEnd":
        return self


class Progress:
    """The feedback of a run: the progress bar (tqdm, on a terminal only) and the lines above it
    (`say`; without a bar, `echo`).  Feedback that cannot be written is dropped, it never stops
    the run."""

    def __init__(self, enabled: bool, echo: Callable[[str], None]):
        self.enabled, self.echo = enabled, echo
        self.bar = None

    def open(self, total: int) -> None:
        if not self.enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", leave=False, file=sys.stderr, disable=None)
            if self.bar.disable:  # not a terminal: the per-epoch lines are the feedback
                self.bar = None
        except ImportError:  # pragma: no cover
            self.bar = None

    def say(self, line: str) -> None:
        """A feedback line (above the progress bar when there is one)."""
        try:
            if self.bar is not None:
                self.bar.write(line, file=sys.stderr)
            else:
                self.echo(line)
        except (OSError, ValueError, AttributeError):
            self.bar = None

    def update(self, n: int) -> None:
        if self.bar is not None:
            try:
                self.bar.update(n)
            except (OSError, ValueError, AttributeError):  # feedback lost, never the run
                self.bar = None

    def postfix(self, **kw) -> None:
        if self.bar is not None:
            try:
                self.bar.set_postfix(**kw)
            except (OSError, ValueError, AttributeError):
                self.bar = None

    def close(self) -> None:
        if self.bar is not None:
            try:
                self.bar.close()
            except (OSError, ValueError, AttributeError):
                pass
            self.bar = None


def _without_option(argv: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """argv without `flag VALUE` and `flag=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return tuple(out)


