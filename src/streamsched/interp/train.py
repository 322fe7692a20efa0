"""The training loop's public names, in one place: `train`, its options and result, the
runners, evaluation and the settings `check` shares with `run`.  The code lives in
`streamsched.interp.training` (one module per job: the loop, the data path, evaluation,
checkpoints, the log, the runners); this module only gathers its names so that
`from streamsched.interp.train import ...` keeps working.
"""

from __future__ import annotations

# flake8: noqa: F401  (a module of re-exports)

from streamsched.interp.training.checkpoints import Checkpoints, _json_safe
from streamsched.interp.training.data_path import DATA_HINT, DataPath, _fit_samples, _input_names
from streamsched.interp.training.divergence import (COLLAPSE, DIVERGE_BEST, DIVERGE_MARGIN, DIVERGE_UNIFORM,
                                                    LEARNED, divergence)
from streamsched.interp.training.evaluation import HostEvaluator, evaluate, make_evaluator
from streamsched.interp.training.losses import EpochLosses, TaskFailedError
from streamsched.interp.training.loop import Progress, Run, _without_option, train
from streamsched.interp.training.options import (TrainInterrupted, TrainOptions, TrainResult, _stderr_line,
                                                 _with_help, _x)
from streamsched.interp.training.run_log import RunLog
from streamsched.interp.training.runners import CpuRunner, _human_bytes, _out_of_memory, make_runner
from streamsched.interp.training.settings import (_call, _checkpoint_layout, _init_value, _layout_json,
                                                  _log_output, _planned_steps, _run_inputs, _whole_number,
                                                  check_train_settings, init_params, setting_dir)
from streamsched.interp.training.signals import _quiet_numpy, _signals_deferred

_Run = Run
"""The run's class under its former name (tests patch its methods)."""

__all__ = ["train", "TrainOptions", "TrainResult", "TrainInterrupted", "TaskFailedError", "EpochLosses",
           "CpuRunner", "make_runner", "evaluate", "HostEvaluator", "make_evaluator", "init_params",
           "check_train_settings", "setting_dir", "divergence", "DIVERGE_UNIFORM", "DIVERGE_BEST", "DIVERGE_MARGIN",
           "LEARNED", "COLLAPSE", "DATA_HINT", "Run", "DataPath", "Checkpoints", "RunLog", "Progress"]
