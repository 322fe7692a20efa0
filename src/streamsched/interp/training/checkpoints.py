"""A run's checkpoints: the one it continues (--resume: every array; --resume-weights: the
parameters only), read and checked before the data (X007, X014), and the whole-epoch checkpoints
it writes, atomically, over the one file it may replace (X021 for another file put there)."""

from __future__ import annotations

import math
import os
import time

import numpy as np

from streamsched.diagnostics import StreamschedError
from streamsched.interp.checkpoint import checkpoint_meta, save_checkpoint
from streamsched.interp.resume import Resumed, load_for_resume, load_weights, resume_command
from streamsched.interp.training.options import TrainOptions, _x
from streamsched.interp.training.settings import _checkpoint_layout, _layout_json
from streamsched.interp.training.signals import _signals_deferred
from streamsched.outputs import Output, check_unchanged, file_stamp, same_file


class Checkpoints:
    """The checkpoint side of one run of `program`: `resumed` / `weights` (what --resume or
    --resume-weights loaded, after `load`), `save` (the --save output or None), `saved_epoch`
    (the last whole epoch, from 1, this run wrote), `save_lost` (another file took the
    checkpoint's place during the run), `saved` (the names a checkpoint holds: every buffer
    with an initial value)."""

    def __init__(self, program, opts: TrainOptions, run_id: str, save: Output | None):
        self.program, self.opts, self.run_id, self.save = program, opts, run_id, save
        self.resumed: Resumed | None = None
        self.weights: tuple[dict, dict] | None = None  # --resume-weights: (parameters, metadata)
        self.saved_epoch: int | None = None
        self.save_ident = save.ident if save is not None else None  # the checkpoint file it may replace
        self.save_lost = False
        self.saved = [n for n, _ in program.inits]

    def load(self) -> None:
        """--resume or --resume-weights, read and checked (X007, X014) before the data is: a bad
        checkpoint is reported at once, for what it is, before anything is written."""
        layout = _checkpoint_layout(self.program)
        if self.opts.resume:
            self.resumed = load_for_resume(self.opts.resume, layout, self.opts.data_limit)
        elif self.opts.resume_weights:
            self.weights = load_weights(self.opts.resume_weights, self.program, layout, self.opts.data_limit)

    def write(self, epoch: int, arrays: dict[str, np.ndarray], meta: dict, log_path: str | None) -> None:
        """Write the checkpoint of whole epoch `epoch` with `meta` (the run's record: run, model,
        data, step, lr, history, ...) over the file this run may replace (outputs.check_unchanged:
        the one it wrote last, or the one it was allowed at the start, or nothing; another file
        put there during the run is X021 and kept).  log_path: the run's log, named in the help."""
        rest = {k: v for k, v in meta.items() if k != "history"}
        meta = {"run": self.run_id, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **rest,
                "layout": _layout_json(self.program), "history": [_json_safe(r) for r in meta.get("history", [])]}
        held = self.saved_epoch or (self.resumed.epochs_done if self.resumed and same_file(self.resumed.path,
                                                                                           self.save.full) else 0)
        gone = f"; the checkpoint of epoch {held} that was there is gone" if held else ""
        logged = f" (the log `{log_path}` holds the records of every finished epoch)" if log_path else ""
        try:
            check_unchanged(self.save, self.save_ident,
                            ours=lambda p: (checkpoint_meta(p) or {}).get("run") == self.run_id,
                            help=f"move that file away, then run again{gone}{logged}")
        except StreamschedError:
            self.save_lost = True
            raise
        try:
            with _signals_deferred():  # what the file holds and what an interrupt reports stay one
                save_checkpoint(self.save.full, arrays, meta)
                self.saved_epoch = epoch
                self.save_ident = file_stamp(os.lstat(self.save.full))
        except OSError as exc:
            raise _x("X021", f"cannot write the checkpoint `{self.save.path}` after epoch {epoch}: "
                     f"{exc.strerror or exc}",
                     help="the previous checkpoint, if any, is untouched; free space or name another "
                          "file with --save") from None

    def good(self) -> tuple[str, int] | None:
        """The latest checkpoint of this run's state: (path, whole epochs it holds), or None."""
        if self.save is not None and self.saved_epoch is not None and not self.save_lost:
            return self.save.path, self.saved_epoch
        gone = self.save is not None and (self.save_lost or self.saved_epoch is not None)
        if self.resumed is not None and os.path.exists(self.resumed.path) and not (
                gone and same_file(self.resumed.path, self.save.full)):
            return self.resumed.path, self.resumed.epochs_done
        return None

    def lost_epochs(self, ck: tuple[str, int] | None, done_epoch: int, start_epoch: int) -> str:
        """What a stop loses: ` epochs 4-27 of this run are in no checkpoint: ...`, or ""
        (done_epoch: the last whole epoch of this run; start_epoch: the whole epochs before it)."""
        held = ck[1] if ck else 0
        if done_epoch <= max(held, start_epoch):
            return ""
        first = max(held, start_epoch) + 1
        span = f"epoch {first}" if first == done_epoch else f"epochs {first}-{done_epoch}"
        why = "no --save was given" if self.save is None else f"`{self.save.path}` could not be written"
        return f"{span} of this run {'is' if first == done_epoch else 'are'} in no checkpoint ({why})"

    def kept(self) -> str:
        """`; the checkpoint `ck.npz` holds epoch 3: resume with `...`` for a run that stops on an
        output it cannot write, or ""."""
        ck = self.good()
        if not ck:
            return ""
        cmd = resume_command(self.opts.argv, ck[0])
        return f"; the checkpoint `{ck[0]}` holds epoch {ck[1]}" + (f": resume with `{cmd}`" if cmd else "")


def _json_safe(rec: dict) -> dict:
    """A record with NaN and infinities as null (a test loss can overflow while the training loss
    stays finite), since checkpoint metadata is strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
