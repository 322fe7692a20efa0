"""The training loop's parts, one job each (`streamsched.interp.train` joins them and keeps the
public names):

    losses.py       TaskFailedError, EpochLosses: what every backend's runner reports (a leaf)
    runners.py      CpuRunner, make_runner: the backend behind the loop's small interface
    options.py      TrainOptions, TrainResult, TrainInterrupted, the X-diagnostic helper
    settings.py     the train block's settings checked (check_train_settings), init_params
    divergence.py   the divergence rule of an epoch
    data_path.py    the data: loaded, checked, batched, staged by host tasks or held on the device
    evaluation.py   the test split evaluated: NumPy on the host, or an eval graph on the device
    checkpoints.py  --resume / --resume-weights read, whole-epoch checkpoints written
    run_log.py      the JSON-lines log, appended to only while it is this run's file
    signals.py      interrupts deferred around writes, NumPy's warnings off
    loop.py         train() and Run: settings, outputs and locks, then the epoch loop
"""
