"""Learning-rate schedules (streamsched.interp.lr) and checkpoints (streamsched.interp.checkpoint)."""

from __future__ import annotations

import math
import os
import zipfile

import numpy as np
import pytest

from streamsched.diagnostics import StreamschedError
from streamsched.interp.checkpoint import (
    FORMAT_VERSION,
    WRITER,
    check_meta,
    load_checkpoint,
    program_hash,
    save_checkpoint,
)
from streamsched.interp.ir import Span
from streamsched.interp.lr import make_schedule

SPAN = Span("model.sched", 56, 5, 56, 40)


def only(exc: pytest.ExceptionInfo):
    (d,) = exc.value.diagnostics
    return d


# ---------------------------------------------------------------------------------------------
# Schedules


def test_constant():
    s = make_schedule("constant", (0.1,), {}, total_steps=100)
    assert s(0) == 0.1 and s(99) == 0.1 and s(10_000) == 0.1


def test_step():
    s = make_schedule("step", (1.0,), {"every": 10, "gamma": 0.5}, total_steps=100)
    assert [s(t) for t in (0, 9, 10, 19, 20, 25)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    s = make_schedule("step", (0.1, 30), {}, total_steps=100)  # gamma defaults to 0.1
    assert s(29) == 0.1 and s(30) == pytest.approx(0.01) and s(60) == pytest.approx(0.001)


def test_cosine_with_warmup():
    s = make_schedule("cosine", (0.1,), {"warmup": 50}, total_steps=1050)
    assert s(0) == pytest.approx(0.1 / 50)  # warmup starts at v / warmup
    assert s(24) == pytest.approx(0.1 * 25 / 50)
    assert s(49) == pytest.approx(0.1)  # ...and reaches v on its last step
    assert s(50) == pytest.approx(0.1)  # decay starts at v
    assert s(300) == pytest.approx(0.1 * (1 + math.cos(math.pi / 4)) / 2)  # a quarter of the way
    assert s(300) == pytest.approx(0.08535533905932737)
    assert s(550) == pytest.approx(0.05)  # midpoint of the decay: (v + min) / 2
    assert s(1050) == pytest.approx(0.0, abs=1e-15)  # min at total_steps
    assert s(5000) == pytest.approx(0.0, abs=1e-15)  # and after it
    decay = [s(t) for t in range(50, 1051)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_cosine_min_and_no_warmup():
    s = make_schedule("cosine", (0.1,), {"min": 0.01}, total_steps=100)
    assert s(0) == pytest.approx(0.1)
    assert s(50) == pytest.approx(0.055)
    assert s(100) == pytest.approx(0.01) and s(150) == pytest.approx(0.01)
    # PyTorch's CosineAnnealingLR closed form, eta_t = eta_min + (eta_max - eta_min)(1 + cos(pi t / T)) / 2.
    for t in (1, 17, 63, 99):
        assert s(t) == pytest.approx(0.01 + 0.09 * (1 + math.cos(math.pi * t / 100)) / 2)


def test_linear():
    s = make_schedule("linear", (1.0,), {"warmup": 10}, total_steps=110)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0) and s(60) == pytest.approx(0.5) and s(85) == pytest.approx(0.25)
    assert s(110) == 0.0 and s(500) == 0.0
    assert str(s) == "linear(v=1.0, warmup=10)"


def test_unknown_schedule_is_X004_listing_known():
    with pytest.raises(StreamschedError) as e:
        make_schedule("cosin", (0.1,), {}, total_steps=10, span=SPAN)
    d = only(e)
    assert d.code == "X004" and d.span == SPAN
    assert d.message == "unknown learning-rate schedule `cosin`; known: constant, step, cosine, linear"
    assert "did you mean `cosine`" in d.help


@pytest.mark.parametrize(
    "name,args,kwargs,total,needle",
    [
        ("cosine", (0.1,), {"warmpu": 5}, 100, "`warmpu`"),
        ("cosine", (), {}, 100, "needs argument `v`"),
        ("step", (0.1,), {}, 100, "needs argument `every`"),
        ("step", (0.1,), {"every": 0}, 100, "`every`"),
        ("step", (0.1,), {"every": 10, "gamma": 0}, 100, "`gamma`"),
        ("cosine", (0.1,), {"warmup": 500}, 100, "longer than the run"),
        ("cosine", (0.1,), {"warmup": 2.5}, 100, "`warmup`"),
        ("cosine", (0.1,), {"min": 0.5}, 100, "`min`"),
        ("constant", (-0.1,), {}, 100, "non-negative"),
        ("constant", ("0.1",), {}, 100, "non-negative"),
        ("constant", (True,), {}, 100, "non-negative"),
        ("constant", (0.1, 0.2), {}, 100, "at most 1 positional"),
        ("constant", (0.1,), {}, 0, "at least 1"),
    ],
)
def test_bad_schedule_arguments_are_X004(name, args, kwargs, total, needle):
    with pytest.raises(StreamschedError) as e:
        make_schedule(name, args, kwargs, total_steps=total, span=SPAN)
    d = only(e)
    assert d.code == "X004" and d.span == SPAN and needle in d.message


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _arrays():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 5)).astype(np.float32)
    w[0, 0], w[0, 1], w[0, 2] = np.nan, -0.0, np.inf
    return {
        "mlp.w1": w,
        "mlp.b1": rng.standard_normal(5).astype(np.float64),
        "opt.velocity/w1": rng.standard_normal((7, 5)).astype(np.float16),
        "step_count": np.array(1234, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "empty": np.zeros((0, 3), np.int32),
        "fortran": np.asfortranarray(rng.standard_normal((3, 4)).astype(np.float32)),
    }


def _meta(**over):
    m = {"model": "mlp", "epoch": 3, "step": 17, "seed": 0, "lr_step": 140,
         "program": program_hash("model mlp() {}\n"), "history": {"loss": [2.3, 1.1]}, "shape": (2, 3)}
    m.update(over)
    return m


def test_checkpoint_round_trip_is_bitwise(tmp_path):
    path = tmp_path / "ckpt.npz"
    arrays = _arrays()
    save_checkpoint(path, arrays, _meta())
    got, meta = load_checkpoint(path)
    assert set(got) == set(arrays)
    for k, a in arrays.items():
        assert got[k].dtype == a.dtype and got[k].shape == a.shape
        assert got[k].tobytes(order="A") == a.tobytes(order="A"), k  # NaN and -0.0 included
    assert meta == dict(_meta(), format=FORMAT_VERSION, writer=WRITER, shape=[2, 3])  # tuples come back as lists


def test_checkpoint_holds_no_pickle(tmp_path):
    path = tmp_path / "ckpt.npz"
    save_checkpoint(path, _arrays(), _meta())
    with zipfile.ZipFile(path) as zf:
        assert "__meta__.npy" in zf.namelist()
    with np.load(path, allow_pickle=False) as z:  # every member loads without pickle
        assert z["__meta__"].dtype == np.uint8
        for k in z.files:
            assert not z[k].dtype.hasobject
    with pytest.raises(ValueError):
        save_checkpoint(path, {"bad": np.array([1, None], dtype=object)}, {})
    with pytest.raises(ValueError):
        save_checkpoint(path, {"__meta__": np.zeros(1)}, {})
    with pytest.raises(ValueError):
        save_checkpoint(path, {"w": np.zeros(1)}, {"f": object()})


def test_any_buffer_name_is_a_checkpoint_key(tmp_path):
    """np.savez(**arrays) would reserve `file` and `allow_pickle`: a `state { file : ... }` saves."""
    arrays = {"file": np.arange(3, dtype=np.float16), "allow_pickle": np.array(2, np.int32), "c1.w": np.ones((2, 3))}
    save_checkpoint(tmp_path / "c.npz", arrays, _meta(step=1))
    back, _ = load_checkpoint(tmp_path / "c.npz")
    assert set(back) == set(arrays)
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        np.testing.assert_array_equal(back[k], v)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.npz"
    save_checkpoint(path, {"w": np.arange(4.0)}, _meta(step=1))
    assert os.listdir(tmp_path) == ["ckpt.npz"]  # no temporary file left behind on success

    # The protocol: fsync the file, rename over the target, then fsync the folder.
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.path.dirname(a))), real_replace(a, b))[1])
    save_checkpoint(path, {"w": np.arange(5.0)}, _meta(step=2))
    assert events == ["fsync", ("replace", str(tmp_path)), "fsync"]
    monkeypatch.undo()
    assert load_checkpoint(path)[1]["step"] == 2

    # A failure part-way through writing leaves the old checkpoint whole and no temporary file.
    def boom(fh, arr, **kw):
        fh.write(b"\x93NUMPY half an array")
        raise OSError("disk full")

    monkeypatch.setattr(np.lib.format, "write_array", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"w": np.arange(6.0)}, _meta(step=3))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.npz"]
    arrays, meta = load_checkpoint(path)
    np.testing.assert_array_equal(arrays["w"], np.arange(5.0))
    assert meta["step"] == 2


def test_load_missing_or_corrupt_is_X007(tmp_path):
    with pytest.raises(StreamschedError) as e:
        load_checkpoint(tmp_path / "absent.npz")
    d = only(e)
    assert d.code == "X007" and "does not exist" in d.message

    path = tmp_path / "ckpt.npz"
    save_checkpoint(path, _arrays(), _meta())
    raw = path.read_bytes()
    cases = {
        "garbage.npz": b"this is not a checkpoint",
        "truncated.npz": raw[: len(raw) // 2],
        "empty.npz": b"",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    np.savez(tmp_path / "nometa.npz", w=np.zeros(3))
    np.save(tmp_path / "single.npy", np.zeros(3))
    np.savez(tmp_path / "badjson.npz", __meta__=np.frombuffer(b"{not json", np.uint8))
    np.savez(tmp_path / "newer.npz", __meta__=np.frombuffer(b'{"format": 99}', np.uint8))
    np.savez(tmp_path / "pickled.npz", __meta__=np.frombuffer(b'{"format": 1}', np.uint8),
             w=np.array([None], dtype=object))
    for name in [*cases, "nometa.npz", "single.npy", "badjson.npz", "newer.npz", "pickled.npz", ""]:
        with pytest.raises(StreamschedError) as e:
            load_checkpoint(tmp_path / name)  # "" is the folder itself
        assert only(e).code == "X007", name


def test_check_meta_refuses_another_program_X008(tmp_path):
    path = tmp_path / "ckpt.npz"
    save_checkpoint(path, {"w": np.zeros(2)}, _meta())
    _, meta = load_checkpoint(path)
    check_meta(meta, {"model": "mlp", "program": program_hash("model mlp() {}\n"), "seed": 0,
                      "format": FORMAT_VERSION, "shape": (2, 3)})  # matches: no exception

    with pytest.raises(StreamschedError) as e:
        check_meta(meta, {"model": "mlp", "program": program_hash("model mlp(hidden = 512) {}\n")}, span=SPAN)
    d = only(e)
    assert d.code == "X008" and "`program`" in d.message and d.span == SPAN and ".sched program changed" in d.help

    with pytest.raises(StreamschedError) as e:
        check_meta(meta, {"model": "cnn", "seed": 1, "lr_schedule": "cosine"})
    ds = e.value.diagnostics
    assert [d.code for d in ds] == ["X008"] * 3
    assert "`model` is 'mlp' in the checkpoint, 'cnn' here" in ds[0].message
    assert "`seed`" in ds[1].message and "no `lr_schedule`" in ds[2].message


def test_program_hash():
    assert program_hash("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert program_hash("a") != program_hash("b")
