"""Data sources, model-fit checks and batching (streamsched.interp.data).

The IDX fixtures are written byte by byte here (struct, not the parser under test), so a
round trip checks the parser against the file format, not against itself.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import pytest

from streamsched.diagnostics import StreamschedError
from streamsched.interp.data import Batches, Dataset, check_compatible, load_dataset, parse_idx
from streamsched.interp.ir import Span

SPAN = Span("model.sched", 54, 5, 54, 44)


def codes(exc: pytest.ExceptionInfo) -> list[str]:
    return [d.code for d in exc.value.diagnostics]


def only(exc: pytest.ExceptionInfo):
    (d,) = exc.value.diagnostics
    return d


# ---------------------------------------------------------------------------------------------
# IDX fixture writer (the MNIST file format, http://yann.lecun.com/exdb/mnist/)

_CODES = {np.dtype("u1"): 0x08, np.dtype("i1"): 0x09, np.dtype("i2"): 0x0B, np.dtype("i4"): 0x0C,
          np.dtype("f4"): 0x0D, np.dtype("f8"): 0x0E}


def idx_bytes(arr: np.ndarray) -> bytes:
    code = _CODES[arr.dtype.newbyteorder("=")]
    head = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.astype(arr.dtype.newbyteorder(">")).tobytes()


def write_idx(path: str, arr: np.ndarray, gz: bool = False) -> str:
    data = idx_bytes(arr)
    if gz:
        path += ".gz"
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


def make_mnist(directory, n_train=20, n_test=8, rows=4, cols=3, gz=(False, False, False, False), seed=1):
    """Four MNIST-format files in directory; returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, rows, cols), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, rows, cols), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    os.makedirs(directory, exist_ok=True)
    for (name, arr), z in zip(arrays.items(), gz):
        write_idx(os.path.join(directory, name), arr, gz=z)
    return arrays


# ---------------------------------------------------------------------------------------------
# digits


def test_digits_sizes_dtypes_and_range():
    ds = load_dataset("digits", (), {"test": 0.2, "seed": 0}, base_dir=".")
    assert isinstance(ds, Dataset)
    assert ds.x_train.shape == (1437, 64) and ds.x_test.shape == (360, 64)
    assert ds.y_train.shape == (1437,) and ds.y_test.shape == (360,)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
    assert ds.x_test.dtype == np.float32 and ds.y_test.dtype == np.int32
    allx = np.concatenate([ds.x_train, ds.x_test])
    assert allx.min() == 0.0 and allx.max() == 1.0
    assert set(np.unique(ds.y_train)) == set(range(10)) and set(np.unique(ds.y_test)) == set(range(10))
    assert ds.num_classes == 10 and ds.sample_shape == (64,)
    assert ds.name == "digits(test=0.2, seed=0)"
    assert not ds.x_train.flags.writeable


def test_digits_is_the_sklearn_set_scaled_by_16_and_stratified():
    from sklearn.datasets import load_digits

    ref = load_digits()
    ds = load_dataset("digits", (), {}, base_dir=".")  # defaults: test = 0.2, seed = 0
    got = np.concatenate([ds.x_train, ds.x_test]) * 16
    # Same multiset of rows: sort both row-wise lexicographically.
    key = lambda a: a[np.lexsort(a.T[::-1])]
    np.testing.assert_array_equal(key(got.astype(np.float64)), key(ref.data))
    # Stratified: each class has 35..37 test samples (178..183 per class * 0.2).
    counts = np.bincount(ds.y_test, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37


def test_digits_deterministic_and_seed_dependent():
    a = load_dataset("digits", (0.2, 3), {}, base_dir=".")
    b = load_dataset("digits", (), {"seed": 3}, base_dir=".")
    c = load_dataset("digits", (), {"seed": 4}, base_dir=".")
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.y_train, c.y_train)
    d = load_dataset("digits", (), {"test": 0.5}, base_dir=".")
    assert len(d.y_train) + len(d.y_test) == 1797 and len(d.y_test) in (898, 899)


@pytest.mark.parametrize("kwargs", [{"test": 0.0}, {"test": 1.0}, {"test": 1.5}, {"test": "0.2"},
                                    {"test": True}, {"seed": -1}, {"seed": 0.5}, {"tset": 0.1}])
def test_digits_bad_arguments_are_X004(kwargs):
    with pytest.raises(StreamschedError) as e:
        load_dataset("digits", (), kwargs, base_dir=".", span=SPAN)
    d = only(e)
    assert d.code == "X004" and d.span == SPAN and d.help


def test_digits_unknown_keyword_suggests_the_right_one():
    with pytest.raises(StreamschedError) as e:
        load_dataset("digits", (), {"tset": 0.1}, base_dir=".")
    d = only(e)
    assert "`tset`" in d.message and "did you mean `test`" in d.help


def test_digits_too_many_positionals_and_duplicates():
    with pytest.raises(StreamschedError) as e:
        load_dataset("digits", (0.2, 0, 5), {}, base_dir=".")
    assert codes(e) == ["X004"]
    with pytest.raises(StreamschedError) as e:
        load_dataset("digits", (0.2,), {"test": 0.3}, base_dir=".")
    assert codes(e) == ["X004"] and "twice" in only(e).message


def test_unknown_source_is_X001_listing_known_ones():
    with pytest.raises(StreamschedError) as e:
        load_dataset("mnist", (), {}, base_dir=".", span=SPAN)
    d = only(e)
    assert d.code == "X001" and d.span == SPAN and "`mnist`" in d.message
    for name in ("digits", "idx", "npz"):
        assert name in d.help


# ---------------------------------------------------------------------------------------------
# idx


@pytest.mark.parametrize("gz", [(False,) * 4, (True,) * 4, (True, False, False, True)])
def test_idx_round_trip(tmp_path, gz):
    arrays = make_mnist(tmp_path / "mnist", gz=gz)
    ds = load_dataset("idx", ("mnist",), {}, base_dir=str(tmp_path))  # relative to base_dir
    xi, yi = arrays["train-images-idx3-ubyte"], arrays["train-labels-idx1-ubyte"]
    assert ds.x_train.shape == (20, 12) and ds.x_test.shape == (8, 12)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
    np.testing.assert_array_equal(ds.x_train, (xi.reshape(20, 12) / np.float32(255)).astype(np.float32))
    np.testing.assert_allclose(ds.x_train * 255, xi.reshape(20, 12), atol=1e-4)
    np.testing.assert_array_equal(ds.y_train, yi.astype(np.int32))
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert ds.num_classes == int(max(yi.max(), arrays["t10k-labels-idx1-ubyte"].max())) + 1
    assert ds.name == f"idx({tmp_path / 'mnist'})"


def test_idx_absolute_path_and_keyword(tmp_path):
    make_mnist(tmp_path / "m")
    ds = load_dataset("idx", (), {"path": str(tmp_path / "m")}, base_dir="/nonexistent")
    assert len(ds.y_train) == 20


def test_parse_idx_header_types():
    a = np.arange(-6, 6, dtype=np.int16).reshape(3, 4)
    np.testing.assert_array_equal(parse_idx(idx_bytes(a)), a)
    f = np.linspace(0, 1, 10).astype(np.float32)
    out = parse_idx(idx_bytes(f))
    assert out.dtype == np.float32 and out.dtype.isnative
    np.testing.assert_array_equal(out, f)
    # The MNIST magic numbers, spelled out: 0x00000803 for images, 0x00000801 for labels.
    assert idx_bytes(np.zeros((2, 3, 3), np.uint8))[:4] == b"\x00\x00\x08\x03"
    assert idx_bytes(np.zeros(2, np.uint8))[:4] == b"\x00\x00\x08\x01"


def _replace(directory, name, raw: bytes, gz=False):
    for suffix in ("", ".gz"):
        p = os.path.join(directory, name + suffix)
        if os.path.exists(p):
            os.remove(p)
    if gz:
        with gzip.open(os.path.join(directory, name + ".gz"), "wb") as f:
            f.write(raw)
    else:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(raw)


def test_idx_bad_magic_is_X003(tmp_path):
    arrays = make_mnist(tmp_path)
    raw = bytearray(idx_bytes(arrays["train-images-idx3-ubyte"]))
    raw[0:4] = b"\x1f\x8b\x08\x03"  # e.g. a .gz file saved under the plain name
    _replace(tmp_path, "train-images-idx3-ubyte", bytes(raw))
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", (str(tmp_path),), {}, base_dir=".", span=SPAN)
    d = only(e)
    assert d.code == "X003" and "magic" in d.message and "train-images-idx3-ubyte" in d.message
    assert d.span == SPAN


@pytest.mark.parametrize("gz", [False, True])
def test_idx_truncated_is_X003(tmp_path, gz):
    arrays = make_mnist(tmp_path)
    raw = idx_bytes(arrays["t10k-images-idx3-ubyte"])
    _replace(tmp_path, "t10k-images-idx3-ubyte", raw[:-7], gz=gz)
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", (str(tmp_path),), {}, base_dir=".")
    d = only(e)
    assert d.code == "X003" and "truncated" in d.message and "(8, 4, 3) needs 96 data bytes, found 89" in d.message


def test_idx_truncated_header_trailing_bytes_and_bad_gzip(tmp_path):
    arrays = make_mnist(tmp_path)
    raw = idx_bytes(arrays["train-labels-idx1-ubyte"])
    for bad, gz in ((raw[:6], False), (raw + b"\x00", False), (b"\x00\x00", False)):
        _replace(tmp_path, "train-labels-idx1-ubyte", bad, gz=gz)
        with pytest.raises(StreamschedError) as e:
            load_dataset("idx", (str(tmp_path),), {}, base_dir=".")
        assert codes(e) == ["X003"]
    _replace(tmp_path, "train-labels-idx1-ubyte", raw)
    with open(tmp_path / "train-labels-idx1-ubyte", "rb") as f:
        good = f.read()
    os.remove(tmp_path / "train-labels-idx1-ubyte")
    with open(tmp_path / "train-labels-idx1-ubyte.gz", "wb") as f:
        f.write(gzip.compress(good)[:-10])  # a cut-off gzip stream
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", (str(tmp_path),), {}, base_dir=".")
    assert codes(e) == ["X003"]


def test_idx_non_integer_or_mismatched_labels_are_X003(tmp_path):
    make_mnist(tmp_path)
    _replace(tmp_path, "train-labels-idx1-ubyte", idx_bytes(np.zeros(20, np.float32)))
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", (str(tmp_path),), {}, base_dir=".")
    assert codes(e) == ["X003"] and "not integers" in only(e).message
    _replace(tmp_path, "train-labels-idx1-ubyte", idx_bytes(np.zeros(19, np.uint8)))
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", (str(tmp_path),), {}, base_dir=".")
    assert codes(e) == ["X003"] and "20 train samples" in only(e).message


def test_idx_missing_folder_or_file_is_X002(tmp_path):
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", ("no/such/dir",), {}, base_dir=str(tmp_path), span=SPAN)
    d = only(e)
    assert d.code == "X002" and str(tmp_path / "no/such/dir") in d.message and d.span == SPAN
    make_mnist(tmp_path / "m")
    os.remove(tmp_path / "m" / "t10k-labels-idx1-ubyte")
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", ("m",), {}, base_dir=str(tmp_path))
    d = only(e)
    assert d.code == "X002" and "t10k-labels-idx1-ubyte" in d.message


def test_idx_needs_a_path_X004():
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", (), {}, base_dir=".")
    assert codes(e) == ["X004"]
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", (3,), {}, base_dir=".")
    assert codes(e) == ["X004"]


# ---------------------------------------------------------------------------------------------
# npz


def _npz_arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"x_train": rng.random((10, 2, 3)), "y_train": rng.integers(0, 4, 10),
            "x_test": rng.random((4, 2, 3)), "y_test": np.array([0, 1, 2, 3], np.int64)}


def test_npz_round_trip(tmp_path):
    a = _npz_arrays()
    np.savez(tmp_path / "d.npz", **a)
    ds = load_dataset("npz", ("d.npz",), {}, base_dir=str(tmp_path))
    assert ds.x_train.shape == (10, 2, 3) and ds.x_train.dtype == np.float32
    np.testing.assert_array_equal(ds.x_train, a["x_train"].astype(np.float32))
    np.testing.assert_array_equal(ds.y_train, a["y_train"])
    assert ds.y_test.dtype == np.int32 and ds.num_classes == 4 and ds.sample_shape == (2, 3)


def test_npz_object_arrays_are_refused_X003(tmp_path):
    a = _npz_arrays()
    a["y_train"] = np.array([1, "two", None, 3, 0, 1, 2, 3, 0, 1], dtype=object)
    np.savez(tmp_path / "p.npz", **a)  # pickles the object array
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("p.npz",), {}, base_dir=str(tmp_path), span=SPAN)
    d = only(e)
    assert d.code == "X003" and "pickle" in d.message and "y_train" in d.message and d.span == SPAN


def test_npz_bad_contents_are_X003(tmp_path):
    a = _npz_arrays()
    np.savez(tmp_path / "k.npz", x_train=a["x_train"], y_train=a["y_train"])
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("k.npz",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X003"] and "x_test, y_test" in only(e).message

    b = dict(a, y_train=a["y_train"].astype(np.float32))
    np.savez(tmp_path / "f.npz", **b)
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("f.npz",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X003"] and "not integers" in only(e).message

    c = dict(a, y_test=np.array([0, -1, 2, 3]))
    np.savez(tmp_path / "n.npz", **c)
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("n.npz",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X003"]

    (tmp_path / "g.npz").write_bytes(b"not a zip file at all")
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("g.npz",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X003"]

    np.save(tmp_path / "one.npy", a["x_train"])
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("one.npy",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X003"]


def test_npz_missing_is_X002(tmp_path):
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("absent.npz",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X002"] and str(tmp_path / "absent.npz") in only(e).message


# ---------------------------------------------------------------------------------------------
# check_compatible


def test_check_compatible():
    ds = load_dataset("digits", (), {}, base_dir=".")
    check_compatible(ds, (128, 64), "i32", 10, SPAN)  # fits: no exception
    check_compatible(ds, (1, 64), None, None)
    with pytest.raises(StreamschedError) as e:
        check_compatible(ds, (128, 784), "i32", 10, SPAN)
    d = only(e)
    assert d.code == "X005" and "[64]" in d.message and "[784]" in d.message and d.span == SPAN
    with pytest.raises(StreamschedError) as e:
        check_compatible(ds, (128, 8, 8), "i32", 10)
    assert codes(e) == ["X005"] and "64 values" in only(e).help
    with pytest.raises(StreamschedError) as e:
        check_compatible(ds, (128, 64), "i32", 5)
    d = only(e)
    assert d.code == "X005" and "labels up to 9" in d.message and "5 classes" in d.message
    with pytest.raises(StreamschedError) as e:
        check_compatible(ds, (128, 64), "f32", 10)
    assert codes(e) == ["X005"]


# ---------------------------------------------------------------------------------------------
# Batches


def _ids(n=23, features=3):
    """x[i] = i in every feature, y[i] = i: each batch row names its sample."""
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], features, axis=1)
    return x, np.arange(n, dtype=np.int32)


def test_batches_every_sample_once_per_epoch_drop_last():
    x, y = _ids(23)
    b = Batches(x, y, batch=5, seed=7)
    assert b.steps_per_epoch == 4
    for e in range(3):
        batches = list(b.epoch(e))
        assert len(batches) == 4
        seen = np.concatenate([yb for _, yb in batches])
        assert len(seen) == 20 and len(np.unique(seen)) == 20  # 20 distinct, 3 dropped
        for xb, yb in batches:
            assert xb.shape == (5, 3) and yb.shape == (5,)
            assert xb.dtype == np.float32 and yb.dtype == np.int32
            assert xb.flags.c_contiguous and yb.flags.c_contiguous
            np.testing.assert_array_equal(xb[:, 0], yb)  # rows stay paired with their labels


def test_batches_keep_last_pads_to_full_batches():
    x, y = _ids(23)
    b = Batches(x, y, batch=5, seed=7, drop_last=False)
    assert b.steps_per_epoch == 5
    batches = list(b.epoch(0))
    assert all(yb.shape == (5,) for _, yb in batches)
    seen = np.concatenate([yb for _, yb in batches])
    assert set(seen) == set(range(23))
    counts = np.bincount(seen, minlength=23)
    assert counts.sum() == 25 and (counts == 2).sum() == 2 and (counts == 1).sum() == 21
    # The two extra rows are the epoch's first two samples.
    np.testing.assert_array_equal(seen[-2:], seen[:2])


def test_batches_deterministic_per_seed_and_epoch():
    x, y = _ids(50)
    a, b, c = Batches(x, y, 8, seed=3), Batches(x, y, 8, seed=3), Batches(x, y, 8, seed=4)
    order = lambda bs, e: np.concatenate([yb for _, yb in bs.epoch(e)])
    np.testing.assert_array_equal(order(a, 2), order(b, 2))
    assert not np.array_equal(order(a, 0), order(a, 1))
    assert not np.array_equal(order(a, 0), order(c, 0))
    # A resumed run (epoch 2, from step 3) sees the same batches as the uninterrupted one.
    full = list(a.epoch(2))
    resumed = list(b.epoch(2, start=3))
    assert len(resumed) == len(full) - 3
    for (x1, y1), (x2, y2) in zip(full[3:], resumed):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    # Known value: pins the generator (np.random.default_rng([seed, epoch])).
    np.testing.assert_array_equal(order(a, 0)[:8], np.random.default_rng([3, 0]).permutation(50)[:8])


def test_batches_that_do_not_fit_are_X006():
    x, y = _ids(10)
    for bad in (11, 0, -1):
        with pytest.raises(StreamschedError) as e:
            Batches(x, y, batch=bad, seed=0, span=SPAN)
        d = only(e)
        assert d.code == "X006" and d.span == SPAN and "between 1 and 10" in d.help
    assert Batches(x, y, batch=10, seed=0).steps_per_epoch == 1


def test_a_data_path_in_an_included_file_is_relative_to_that_file(tmp_path):
    """`include "sub/train.inc"` whose train block says `npz("d.npz")` reads sub/d.npz, both in
    `check` and in `run` (not a d.npz next to the top file)."""
    import os

    from streamsched.interp.train import TrainOptions, check_train_settings, train
    from streamsched.pipeline import compile_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "sub").mkdir()
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "sub" / "d.npz", x_train=rng.random((256, 64)).astype("f4"),
             y_train=rng.integers(0, 10, 256), x_test=rng.random((32, 64)).astype("f4"),
             y_test=rng.integers(0, 10, 32))
    (tmp_path / "sub" / "train.inc").write_text('train {\n    model = mlp\n    data = npz("d.npz")\n'
                                                '    epochs = 1\n}\n')
    text = open(os.path.join(root, "examples", "mlp_digits.sched"), encoding="utf-8").read()
    top = tmp_path / "top.sched"
    top.write_text(text[:text.index("train {")] + 'include "sub/train.inc"\n')
    c = compile_file(str(top))
    assert check_train_settings(c.program) == []
    res = train(c, TrainOptions(backend="cpu", max_steps=1, progress=False), base_dir=str(tmp_path))
    assert res.steps == 1
