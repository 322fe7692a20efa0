"""Reads have bounds: sources, data files and checkpoints are regular files under documented
limits, sizes are checked before anything is decompressed or allocated, pickles are never
loaded, and data that is not finite in f32 is a data error at load naming the file, the array and
the first bad index.  With hypothesis fuzzes of data files and checkpoint files (mutated bytes,
and arrays of random dtypes, shapes and values against an oracle written here)."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import time
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from safety_helpers import assert_untouched, code_of, main, project, run_tiny, snapshot
from streamsched.diagnostics import StreamschedError
from streamsched.interp.checkpoint import load_checkpoint, save_checkpoint
from streamsched.interp.data import load_dataset, parse_idx
from streamsched.reads import ReadError, parse_size, read_npz


def codes(e) -> list[str]:
    return [d.code for d in e.value.diagnostics]


def _npz_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for k, b in members.items():
            zf.writestr(k + ".npy", b)
    return buf.getvalue()


def _npy(a) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def _good(n=16) -> dict[str, np.ndarray]:
    r = np.random.default_rng(0)
    return dict(x_train=r.normal(size=(n, 4)), y_train=r.integers(0, 3, n), x_test=r.normal(size=(8, 4)),
                y_test=r.integers(0, 3, 8))


# ---- sources


def test_an_include_that_is_a_fifo_a_folder_or_too_large(tmp_path, capsys, monkeypatch):
    os.mkfifo(tmp_path / "pipe.sched")
    (tmp_path / "dir.sched").mkdir()
    (tmp_path / "big.sched").write_text("# " + "x" * 5000 + "\n")
    for name, code, words in (("pipe.sched", "S010", "is a FIFO (named pipe), not a regular file"),
                              ("dir.sched", "S010", "is a folder"),
                              ("big.sched", "X014", "over the 4 KiB limit of a .sched file")):
        import streamsched.dsl.load as load_mod

        monkeypatch.setattr(load_mod, "SOURCE_LIMIT", 4096)
        top = tmp_path / "top.sched"
        top.write_text(f'include "{name}"\nstreams {{ c : compute }}\n')
        t = time.perf_counter()
        rc, out, err = main(capsys, "check", top)
        assert time.perf_counter() - t < 10  # never blocks on the FIFO
        assert rc == 1 and code_of(err) == code and words in err and "top.sched:1:1" in err, err


def test_the_program_itself_is_a_fifo_or_too_large(tmp_path, capsys, monkeypatch):
    os.mkfifo(tmp_path / "p.sched")
    rc, out, err = main(capsys, "check", tmp_path / "p.sched")
    assert rc == 1 and code_of(err) == "X002" and "is a FIFO" in err
    rc, out, err = main(capsys, "check", "--format", "json", tmp_path / "p.sched")
    assert rc == 1 and '"code": "X002"' in out
    import streamsched.dsl.load as load_mod

    monkeypatch.setattr(load_mod, "SOURCE_LIMIT", 10)
    (tmp_path / "q.sched").write_text("streams { c : compute }\n")
    rc, out, err = main(capsys, "check", tmp_path / "q.sched")
    assert rc == 1 and code_of(err) == "X014"


# ---- data files


def test_a_data_file_that_is_a_fifo_is_x002_without_blocking(tmp_path, capsys):
    sched = project(tmp_path)
    os.remove(tmp_path / "tiny.npz")
    os.mkfifo(tmp_path / "tiny.npz")
    for cmd in ("check", "run"):
        rc, out, err = main(capsys, cmd, sched, *(("--backend", "cpu", "-q") if cmd == "run" else ()))
        assert rc == 1 and code_of(err) == "X002" and "is a FIFO (named pipe), not a regular file" in err


@pytest.mark.parametrize("where", ["x_train", "x_test"])
@pytest.mark.parametrize("bad,words", [(np.nan, "holds nan"), (np.inf, "holds inf"), (-np.inf, "holds -inf"),
                                       (1e300, "beyond f32's range")])
def test_data_that_is_not_finite_in_f32_is_x003_at_load(tmp_path, capsys, where, bad, words):
    sched = project(tmp_path)
    a = _good()
    a[where][5, 2] = bad
    np.savez(tmp_path / "tiny.npz", **a)
    before = snapshot(tmp_path)
    rc, out, err = run_tiny(capsys, sched, "--save", tmp_path / "ck.npz")
    assert rc == 1 and code_of(err) == "X003" and out == ""
    assert f"npz: `{where}` in `{tmp_path / 'tiny.npz'}` holds " in err and words in err
    assert "at index [5, 2] (sample 5)" in err
    assert "tiny.sched:27:" in err  # the data line, not the lr
    assert_untouched(before, tmp_path)


def test_f64_within_the_bound_and_f16_data_load(tmp_path):
    a = _good()
    a["x_train"][0, 0] = 1.8e19  # just under sqrt(f32 max): its square is still an f32
    np.savez(tmp_path / "d.npz", **{**a, "x_test": a["x_test"].astype(np.float16)})
    ds = load_dataset("npz", ("d.npz",), {}, base_dir=str(tmp_path))
    assert ds.x_train[0, 0] == np.float32(1.8e19)


@pytest.mark.parametrize("value,dtype", [(3.0e38, np.float64), (1e30, np.float32), (-2e19, np.float32),
                                         (2**64 - 1, np.uint64)])
def test_features_whose_square_overflows_f32_are_refused_at_load(tmp_path, value, dtype):
    """F13: a finite feature of 1e30 made a finite loss of 1e29, reported as X010 on `lr` (even
    with --lr 0): a value beyond sqrt(f32 max) = 1.84e19 is bad data, X003 at load."""
    a = _good()
    x = a["x_train"].astype(dtype)
    x[2, 1] = value
    np.savez(tmp_path / "d.npz", **{**a, "x_train": x})
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("d.npz",), {}, base_dir=str(tmp_path))
    (d,) = e.value.diagnostics
    assert d.code == "X003" and "`x_train`" in d.message and "at index [2, 1] (sample 2)" in d.message
    assert "its square is beyond f32's range" in d.message or "beyond f32's range" in d.message


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_the_first_bad_index_is_reported(tmp_path, data):
    shape = data.draw(st.tuples(st.integers(1, 6), st.integers(1, 5)))
    x = np.zeros(shape)
    cells = data.draw(st.lists(st.tuples(st.integers(0, shape[0] - 1), st.integers(0, shape[1] - 1)),
                               min_size=1, max_size=4))
    for c in cells:
        x[c] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf, 1e39, -5e300]))
    a = dict(x_train=x, y_train=np.zeros(shape[0], np.int64), x_test=np.zeros((1, shape[1])), y_test=np.zeros(1, int))
    np.savez(tmp_path / "d.npz", **a)
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("d.npz",), {}, base_dir=str(tmp_path))
    first = min(cells)  # row-major order is tuple order
    (d,) = e.value.diagnostics
    assert d.code == "X003" and f"at index [{first[0]}, {first[1]}]" in d.message
    n_bad = len(set(cells))
    assert (f"{n_bad} values are" if n_bad > 1 else "1 value is") in d.message


def _idx(a: np.ndarray, code: int = 0x08) -> bytes:
    return bytes([0, 0, code, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(a.dtype.newbyteorder(">")).tobytes()


def _mnist(folder, images=None):
    folder.mkdir(exist_ok=True)
    r = np.random.default_rng(0)
    files = {"train-images-idx3-ubyte": _idx(r.integers(0, 255, (8, 2, 2)).astype(np.uint8)),
             "train-labels-idx1-ubyte": _idx(r.integers(0, 3, 8).astype(np.uint8)),
             "t10k-images-idx3-ubyte": _idx(r.integers(0, 255, (4, 2, 2)).astype(np.uint8)),
             "t10k-labels-idx1-ubyte": _idx(r.integers(0, 3, 4).astype(np.uint8))}
    if images is not None:
        files["train-images-idx3-ubyte"] = images
    for name, raw in files.items():
        (folder / name).write_bytes(raw)


def test_an_idx_gzip_bomb_stops_at_its_header(tmp_path):
    _mnist(tmp_path / "m")
    os.remove(tmp_path / "m" / "train-images-idx3-ubyte")
    with gzip.open(tmp_path / "m" / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 3]) + struct.pack(">3I", 10**6, 100, 100))
        f.write(b"\0" * (4 << 20))  # 4 MiB of the 10 GB it claims
    t = time.perf_counter()
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", ("m",), {}, base_dir=str(tmp_path), limit=1 << 20)
    assert time.perf_counter() - t < 2
    (d,) = e.value.diagnostics
    assert d.code == "X014" and "(shape (1000000, 100, 100)) holds 9.3 GiB (decompressed), over the 1 MiB data limit" \
        in d.message and "--data-limit" in d.help


def test_an_idx_gzip_that_goes_on_past_its_header_is_refused_unread(tmp_path):
    _mnist(tmp_path / "m")
    os.remove(tmp_path / "m" / "train-images-idx3-ubyte")
    with gzip.open(tmp_path / "m" / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(_idx(np.zeros((8, 2, 2), np.uint8)) + b"\0" * (8 << 20))
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", ("m",), {}, base_dir=str(tmp_path), limit=1 << 20)
    assert codes(e) == ["X003"] and "longer than its header says" in str(e.value)


def test_idx_f64_images_beyond_f32_are_x003(tmp_path):
    img = np.zeros((8, 2, 2))
    img[3, 1, 0] = 1e300
    _mnist(tmp_path / "m", images=_idx(img, 0x0E))
    with pytest.raises(StreamschedError) as e:
        load_dataset("idx", ("m",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X003"] and "at index [3, 1, 0]" in str(e.value) and "train-images-idx3-ubyte" in str(e.value)


def test_the_data_limit_counts_every_file_and_can_be_raised(tmp_path, capsys, monkeypatch):
    sched = project(tmp_path)
    rc, out, err = run_tiny(capsys, sched, "--data-limit", "200")
    assert rc == 1 and code_of(err) == "X014" and "over the 200 bytes data limit" in err
    monkeypatch.setenv("STREAMSCHED_DATA_LIMIT", "200")
    assert code_of(run_tiny(capsys, sched)[2]) == "X014"
    assert run_tiny(capsys, sched, "--data-limit", "1M")[0] == 0  # the flag wins
    monkeypatch.setenv("STREAMSCHED_DATA_LIMIT", "lots")
    rc, out, err = run_tiny(capsys, sched)
    assert rc == 1 and code_of(err) == "X004" and "STREAMSCHED_DATA_LIMIT" in err
    rc, out, err = run_tiny(capsys, sched, "--data-limit", "4x")
    assert rc == 1 and "error[X004]" in err and "not a size" in err


def test_parse_size():
    assert [parse_size(s) for s in ("1", "1k", "2K", "1.5M", "4G", "4GiB", "16gb", "1T")] == \
        [1, 1024, 2048, 1572864, 4 << 30, 4 << 30, 16 << 30, 1 << 40]
    for bad in ("", "0", "-1", "x", "4 ib", "1e9", "G"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("member,words", [
    (pickle.dumps([1, 2, 3]), "is an object (pickled) array"),  # raw pickle bytes, no .npy header
    (b"not numpy at all", "is not a NumPy .npy array"),
])
def test_npz_members_that_are_not_npy_arrays(tmp_path, member, words):
    g = {k: _npy(v) for k, v in _good().items()}
    g["x_train"] = member
    (tmp_path / "d.npz").write_bytes(_npz_bytes(g))
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("d.npz",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X003"] and words in str(e.value) and "x_train" in str(e.value)


def _huge_header(shape=(2_000_000, 1_000_000)) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return buf.getvalue() + b"\0" * 64


def test_an_npy_header_claiming_2e12_elements_is_refused_before_allocation(tmp_path):
    g = {k: _npy(v) for k, v in _good().items()}
    g["x_train"] = _huge_header()
    (tmp_path / "d.npz").write_bytes(_npz_bytes(g))
    with pytest.raises(StreamschedError) as e:
        load_dataset("npz", ("d.npz",), {}, base_dir=str(tmp_path))
    assert codes(e) == ["X003"] and "claims shape (2000000, 1000000) of float32 (7.3 TiB) but the member holds 64 bytes" \
        in str(e.value)


# ---- checkpoints


def _ck(tmp_path) -> tuple[str, dict, dict]:
    path = str(tmp_path / "ck.npz")
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1.5, -0.0], np.float64),
              "t": np.array(7, np.int64)}
    save_checkpoint(path, arrays, {"model": "m", "program": "p", "epoch": 1})
    return path, arrays, load_checkpoint(path)[1]


def test_checkpoint_members_that_are_pickles_or_claim_too_much(tmp_path):
    path, arrays, meta = _ck(tmp_path)
    for member, words in ((pickle.dumps({"w": 1}), "pickled"), (_huge_header(), "claims shape")):
        (tmp_path / "bad.npz").write_bytes(_npz_bytes({"w": member, "__meta__": _npy(np.frombuffer(b'{"format": 2}',
                                                                                                       np.uint8))}))
        with pytest.raises(StreamschedError) as e:
            load_checkpoint(tmp_path / "bad.npz")
        assert codes(e) == ["X007"] and words in str(e.value)


def test_checkpoint_that_is_a_fifo_or_over_the_limit(tmp_path):
    os.mkfifo(tmp_path / "pipe.npz")
    with pytest.raises(StreamschedError) as e:
        load_checkpoint(tmp_path / "pipe.npz")
    assert codes(e) == ["X007"] and "is a FIFO (named pipe), not a checkpoint file" in str(e.value)
    path, arrays, meta = _ck(tmp_path)
    with pytest.raises(StreamschedError) as e:
        load_checkpoint(path, limit=64)
    assert codes(e) == ["X014"]
    assert load_checkpoint(path, limit=1 << 20)[0].keys() == arrays.keys()


def test_save_checkpoint_never_replaces_a_fifo_or_a_link(tmp_path):
    os.mkfifo(tmp_path / "pipe.npz")
    os.symlink("elsewhere.npz", tmp_path / "link.npz")
    for name in ("pipe.npz", "link.npz"):
        with pytest.raises(OSError):
            save_checkpoint(tmp_path / name, {"w": np.zeros(2)}, {})
    assert sorted(os.listdir(tmp_path)) == ["link.npz", "pipe.npz"]  # and no temporary file left


# ---- fuzz: mutated data files and checkpoints


FUZZ_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                                  HealthCheck.too_slow])


def _mutate(data: bytes, draw) -> bytes:
    raw = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "zero"]))
        if not raw:
            break
        i = draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[i] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del raw[i:i + draw(st.integers(1, 64))]
        elif kind == "insert":
            raw[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            raw[i:i + 8] = b"\xff" * 8
    return bytes(raw)


@FUZZ_SETTINGS
@given(st.data())
def test_fuzz_mutated_data_files_load_or_are_refused_with_a_code(tmp_path, data):
    good = _good()
    base = io.BytesIO()
    np.savez_compressed(base, **good) if data.draw(st.booleans()) else np.savez(base, **good)
    raw = _mutate(base.getvalue(), data.draw)
    (tmp_path / "f.npz").write_bytes(raw)
    try:
        ds = load_dataset("npz", ("f.npz",), {}, base_dir=str(tmp_path), limit=1 << 20)
    except StreamschedError as e:
        assert {d.code for d in e.diagnostics} <= {"X003", "X014"}, e.value
        return
    # A mutation that loads changed nothing the CRCs guard: the arrays are the original ones.
    assert np.array_equal(ds.x_train, good["x_train"].astype(np.float32))
    assert np.array_equal(ds.y_test, good["y_test"].astype(np.int32))


DTYPES = ["f2", "f4", "f8", ">f8", "i1", "u1", "i4", "i8", "u8", "b1", "c8", "U3", "O"]


@FUZZ_SETTINGS
@given(st.data())
def test_fuzz_arrays_of_any_dtype_and_shape_against_an_oracle(tmp_path, data):
    def arr(label: bool):
        dt = np.dtype(data.draw(st.sampled_from(DTYPES)))
        shape = tuple(data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
        n = int(np.prod(shape))
        if dt.kind == "O":
            return np.array([None] * n, dtype=object).reshape(shape)
        vals = data.draw(st.lists(st.sampled_from([0, 1, 2, -1, 0.5, np.nan, np.inf, 1e39]), min_size=n, max_size=n))
        with np.errstate(all="ignore"):
            if dt.kind in "iub":
                vals = [int(v) if np.isfinite(v) else 0 for v in vals]
                if dt.kind == "u":
                    vals = [abs(v) for v in vals]
            return np.array(vals, dtype=np.float64).astype(dt).reshape(shape)

    a = {"x_train": arr(False), "y_train": arr(True), "x_test": arr(False), "y_test": arr(True)}
    np.savez(tmp_path / "f.npz", **a)

    def oracle() -> bool:  # what load_dataset must accept, written independently
        for k in ("x_train", "x_test"):
            x = a[k]
            if x.dtype.kind not in "biuf" or x.ndim < 2:
                return False
            if x.dtype.kind == "f" and (not np.isfinite(x).all() or (np.abs(x.astype(np.float64)) > 3.4028234663852886e38).any()):
                return False
        if a["x_train"].shape[1:] != a["x_test"].shape[1:]:
            return False
        for xk, yk in (("x_train", "y_train"), ("x_test", "y_test")):
            y = a[yk]
            if y.dtype.kind not in "iu" or y.ndim != 1 or len(y) != len(a[xk]):
                return False
            if len(y) and (y.min() < 0 or y.max() > 2**31 - 1):
                return False
        return len(a["x_train"]) > 0 and len(a["x_test"]) > 0

    try:
        ds = load_dataset("npz", ("f.npz",), {}, base_dir=str(tmp_path))
        ok = True
    except StreamschedError as e:
        assert {d.code for d in e.diagnostics} == {"X003"}, e.value
        ok = False
    assert ok == oracle(), {k: (v.dtype, v.shape) for k, v in a.items()}
    if ok:
        assert np.array_equal(ds.x_train, a["x_train"].astype(np.float32))


@pytest.fixture(scope="module")
def ck_bytes(tmp_path_factory):
    path, arrays, meta = _ck(tmp_path_factory.mktemp("ck"))
    with open(path, "rb") as f:
        return f.read(), arrays, meta


@FUZZ_SETTINGS
@given(st.data())
def test_fuzz_mutated_checkpoints_load_exactly_or_are_x007(tmp_path, ck_bytes, data):
    good, arrays, meta = ck_bytes
    path = tmp_path / "ck.npz"
    path.write_bytes(_mutate(good, data.draw))
    try:
        got, got_meta = load_checkpoint(path, limit=1 << 20)
    except StreamschedError as e:
        assert {d.code for d in e.diagnostics} <= {"X007", "X014"}, e
        return
    assert got_meta == meta and got.keys() == arrays.keys()
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes()


@FUZZ_SETTINGS
@given(st.data())
def test_fuzz_idx_headers_never_allocate_what_they_claim(tmp_path, data):
    code = data.draw(st.sampled_from([0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E, 0x07, 0x00]))
    ndim = data.draw(st.integers(0, 4))
    dims = data.draw(st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 5), min_size=ndim, max_size=ndim))
    payload = data.draw(st.binary(max_size=200))
    raw = bytes([0, 0, code, ndim]) + struct.pack(f">{ndim}I", *dims) + payload
    folder = tmp_path / "m"
    if not folder.exists():
        _mnist(folder)
    gz = data.draw(st.booleans())
    for p in ("train-labels-idx1-ubyte", "train-labels-idx1-ubyte.gz"):
        if (folder / p).exists():
            os.remove(folder / p)
    (folder / ("train-labels-idx1-ubyte" + (".gz" if gz else ""))).write_bytes(gzip.compress(raw, 1) if gz else raw)
    try:
        load_dataset("idx", ("m",), {}, base_dir=str(tmp_path), limit=1 << 16)
    except StreamschedError as e:
        assert {d.code for d in e.diagnostics} <= {"X003", "X014"}, e
    # parse_idx agrees with a header check written here
    itemsize = {0x08: 1, 0x09: 1, 0x0B: 2, 0x0C: 4, 0x0D: 4, 0x0E: 8}.get(code)
    try:
        a = parse_idx(raw, "x")
        assert itemsize and ndim and a.shape == tuple(dims)
        assert len(payload) == int(np.prod(dims, dtype=object)) * itemsize
    except StreamschedError as e:
        assert codes_of(e) == ["X003"]
        fits = itemsize and ndim and len(payload) == int(np.prod(dims, dtype=object)) * itemsize
        assert not fits or "NumPy cannot hold" in str(e)


def codes_of(e: StreamschedError) -> list[str]:
    return [d.code for d in e.diagnostics]


def test_read_npz_bounds_before_decompressing(tmp_path):
    big = np.zeros(1 << 20, np.uint8)  # 1 MiB of zeros compresses to a few KiB
    np.savez_compressed(tmp_path / "z.npz", a=big)
    assert os.path.getsize(tmp_path / "z.npz") < 20000
    with pytest.raises(ReadError) as e:
        read_npz(str(tmp_path / "z.npz"), 1 << 16)
    assert e.value.why == "too_large" and "over the 64 KiB data limit" in e.value.message
    names, arrays = read_npz(str(tmp_path / "z.npz"), 2 << 20)
    assert names == ["a"] and arrays["a"].nbytes == 1 << 20
