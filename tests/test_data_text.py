"""The `text` data source (streamsched.interp.data): byte tokens of UTF-8 files, the contiguous
split, next-token windows and one-pass epochs, every user mistake an X diagnostic naming the file
(missing paths, patterns that match nothing, folders, FIFOs, empty or too-short text, bytes that
are not UTF-8, the data limit), the Python-stdlib corpus, and a tiny text model trained through the
command line.  The expected windows are cut here from the bytes written, not by the loader."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

from safety_helpers import assert_untouched, code_of, main, snapshot
from streamsched.diagnostics import StreamschedError
from streamsched.interp.data import (Batches, check_compatible, check_source, data_paths, load_dataset,
                                     python_stdlib_files)
from streamsched.interp.ir import Span

SPAN = Span("model.sched", 40, 5, 40, 60)


def only(e):
    (d,) = e.value.diagnostics
    return d


def load(path, base, **kw):
    return load_dataset("text", (path,), kw, base_dir=str(base), span=SPAN)


def refused(path, base, **kw):
    with pytest.raises(StreamschedError) as e:
        load(path, base, **kw)
    d = only(e)
    assert d.span == SPAN
    return d


# ---------------------------------------------------------------------------------------------
# Tokens, split, windows


def test_bytes_split_and_windows(tmp_path):
    data = ("def f(x):\n    return x + 1\n" * 20).encode()
    (tmp_path / "a.py").write_bytes(data)
    ds = load("a.py", tmp_path, context=8, test=0.25)
    n = len(data)
    n_test = math.ceil(0.25 * n)
    train, test = np.frombuffer(data[:n - n_test], np.uint8), np.frombuffer(data[n - n_test:], np.uint8)
    assert ds.kind == "text" and ds.name == "text(" + str(tmp_path / "a.py") + ", context=8, test=0.25, seed=0)"
    # every training position is a window; y is x shifted by one byte
    assert ds.x_train.shape == (len(train) - 8, 8) == ds.y_train.shape
    for i in (0, 1, 17, len(train) - 9):
        np.testing.assert_array_equal(ds.x_train[i], train[i:i + 8])
        np.testing.assert_array_equal(ds.y_train[i], train[i + 1:i + 9])
    # the test split: consecutive windows of the held-out tail, no byte of it in training
    m = (len(test) - 1) // 8
    np.testing.assert_array_equal(ds.x_test, test[:8 * m].reshape(m, 8))
    np.testing.assert_array_equal(ds.y_test, test[1:8 * m + 1].reshape(m, 8))
    assert ds.epoch_samples == (len(train) - 1) // 8
    assert ds.num_classes == max(data) + 1
    assert not ds.x_train.flags.writeable and not ds.x_test.flags.writeable
    assert ds.x_train.base is not None  # a view of the bytes, not a copy per window


def test_a_pattern_reads_the_files_in_name_order_and_seed_shuffles_them(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "sub").mkdir()  # folders a pattern matches are skipped
    texts = {"b.txt": b"bbbbbbbbbb\n", "a.txt": b"aaaaaaaaaa\n", "c.txt": b"", "d.txt": "d\u00e9j\u00e0 vu\n".encode()}
    for name, b in texts.items():
        (tmp_path / "corpus" / name).write_bytes(b)
    ds = load("corpus/*", tmp_path, context=4, test=0.3)
    got = np.concatenate([ds.x_train[0], ds.y_train[:, -1], ds.x_test.reshape(-1)[:0]])
    whole = b"".join(texts[k] for k in sorted(texts))
    n_test = math.ceil(0.3 * len(whole))
    assert bytes(got) == whole[:len(whole) - n_test]
    assert ds.num_classes == max(whole) + 1  # UTF-8 characters are several bytes
    files = data_paths("text", ("corpus/*",), {}, base_dir=str(tmp_path))
    assert files == [str(tmp_path / "corpus" / k) for k in sorted(texts)]
    shuffled = load("corpus/*", tmp_path, context=4, test=0.3, seed=3)
    order = np.random.default_rng(3).permutation(4)
    names = [sorted(texts)[i] for i in order]
    whole3 = b"".join(texts[k] for k in names)
    assert bytes(np.concatenate([shuffled.x_train[0], shuffled.y_train[:, -1]])) == whole3[:len(whole3) - n_test]
    assert "seed=3" in shuffled.name


def test_an_epoch_is_one_pass_over_the_training_bytes_in_random_windows(tmp_path):
    (tmp_path / "t.txt").write_bytes(bytes(range(32, 127)) * 30)
    ds = load("t.txt", tmp_path, context=8, test=0.1)
    b = Batches(ds.x_train, ds.y_train, 16, seed=0, epoch_samples=ds.epoch_samples)
    assert b.steps_per_epoch == ds.epoch_samples // 16
    order = b.order(0)
    assert len(order) == b.steps_per_epoch * 16 and len(set(order)) == len(order)  # no window twice
    assert order.max() < len(ds.x_train) and not np.array_equal(order, np.sort(order))
    xb, yb = next(b.epoch(0))
    assert xb.dtype == np.uint8 and xb.shape == (16, 8)
    np.testing.assert_array_equal(xb[:, 1:], yb[:, :-1])
    with pytest.raises(StreamschedError) as e:
        Batches(ds.x_train, ds.y_train, ds.epoch_samples + 1, seed=0, epoch_samples=ds.epoch_samples, span=SPAN)
    assert only(e).code == "X006" and "windows of one epoch" in only(e).message


def test_context_comes_from_the_model_when_not_given(tmp_path):
    (tmp_path / "t.txt").write_text("hello world, " * 40)
    ds = load_dataset("text", ("t.txt",), {}, base_dir=str(tmp_path), sample_shape=(16,))
    assert ds.x_train.shape[1] == 16
    d = refused("t.txt", tmp_path)
    assert d.code == "X004" and "context" in d.message and "context = 128" in d.help


def test_a_model_that_does_not_fit_the_text_is_x005(tmp_path):
    (tmp_path / "t.txt").write_text("hello world, " * 40)
    ds = load("t.txt", tmp_path, context=16)
    with pytest.raises(StreamschedError) as e:
        check_compatible(ds, (4, 32), "i32", 256, SPAN)
    assert only(e).code == "X005" and "[16]" in only(e).message and "[32]" in only(e).message
    with pytest.raises(StreamschedError) as e:
        check_compatible(ds, (4, 16), "i32", 100, SPAN)
    assert only(e).code == "X005" and f"labels up to {ord('w')}" in only(e).message


# ---------------------------------------------------------------------------------------------
# Mistakes, each an X diagnostic naming the file


def test_missing_files_patterns_and_folders_are_x002(tmp_path):
    d = refused("nope.txt", tmp_path, context=4)
    assert d.code == "X002" and str(tmp_path / "nope.txt") in d.message and "does not exist" in d.message
    d = refused("*.nothing", tmp_path, context=4)
    assert d.code == "X002" and "no file matches" in d.message and str(tmp_path / "*.nothing") in d.message
    (tmp_path / "dir").mkdir()
    d = refused("dir", tmp_path, context=4)
    assert d.code == "X002" and "is a folder" in d.message and 'text("dir/*.txt")' in d.help


def test_fifos_are_refused_unopened(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    d = refused("pipe.txt", tmp_path, context=4)
    assert d.code == "X002" and "FIFO" in d.message
    d = refused("*.txt", tmp_path, context=4)
    assert d.code == "X002" and "FIFO" in d.message and "pipe.txt" in d.message


def test_empty_or_too_short_text_is_x003(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    d = refused("empty.txt", tmp_path, context=4)
    assert d.code == "X003" and "is empty" in d.message and "empty.txt" in d.message
    (tmp_path / "short.txt").write_bytes(b"abcdefghij" * 3)
    d = refused("short.txt", tmp_path, context=8, test=0.1)
    assert d.code == "X003" and "30 bytes" in d.message and "test split has 3" in d.message
    assert "context = 8" in d.message and "smaller context" in d.help
    assert load("short.txt", tmp_path, context=2, test=0.2).x_test.shape == (2, 2)


def test_bytes_that_are_not_utf8_are_x003_naming_file_offset_and_line(tmp_path):
    (tmp_path / "ok.txt").write_text("fine text\n" * 10)
    (tmp_path / "latin1.txt").write_bytes("line one\ncaf\u00e9\n".encode("latin-1"))
    for path in ("latin1.txt", "*.txt"):
        d = refused(path, tmp_path, context=4)
        assert d.code == "X003" and "latin1.txt" in d.message and "not UTF-8" in d.message
        assert "byte 0xe9 at offset 12 (line 2)" in d.message and "iconv" in d.help
    # `check` reads nothing: the file exists, so the source checks
    assert check_source("text", ("latin1.txt",), {"context": 4}, base_dir=str(tmp_path))["files"]


@pytest.mark.parametrize("kw,words", [({"context": 0}, "context must be a whole number"),
                                      ({"context": 2.5}, "context must be a whole number"),
                                      ({"test": 1.0}, "strictly between 0 and 1"),
                                      ({"test": "x"}, "strictly between 0 and 1"),
                                      ({"seed": -1}, "seed must be a non-negative integer"),
                                      ({"window": 3}, "has no argument `window`")])
def test_bad_arguments_are_x004(tmp_path, kw, words):
    (tmp_path / "t.txt").write_text("some text " * 20)
    d = refused("t.txt", tmp_path, **{"context": 4, **kw})
    assert d.code == "X004" and words in d.message


def test_unknown_corpus_and_non_string_path_are_x004(tmp_path):
    d = refused("<python-stdlb>", tmp_path, context=4)
    assert d.code == "X004" and "unknown corpus" in d.message and "<python-stdlib>" in d.help
    d = refused(3, tmp_path, context=4)
    assert d.code == "X004" and "path string" in d.message


def test_the_data_limit_counts_every_file(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text("x" * 100)
    assert load_dataset("text", ("*.txt",), {"context": 4}, base_dir=str(tmp_path), limit=300).x_train.size
    with pytest.raises(StreamschedError) as e:
        load_dataset("text", ("*.txt",), {"context": 4}, base_dir=str(tmp_path), limit=250, span=SPAN)
    d = only(e)
    assert d.code == "X014" and "2.txt" in d.message and "data limit" in d.message


# ---------------------------------------------------------------------------------------------
# The Python-stdlib corpus


def test_the_python_stdlib_corpus_is_the_top_level_py_files():
    import sysconfig

    files = python_stdlib_files()
    d = sysconfig.get_paths()["stdlib"]
    assert files == sorted(files) and len(files) > 100
    assert all(os.path.dirname(f) == d and f.endswith(".py") for f in files)
    assert os.path.join(d, "os.py") in files and os.path.join(d, "typing.py") in files
    assert 2e6 < sum(os.path.getsize(f) for f in files) < 2e7  # about 4.7 MB (CPython 3.11-3.13)
    ds = load_dataset("text", ("<python-stdlib>",), {"context": 64, "test": 0.02}, base_dir=".")
    assert ds.name == "text(<python-stdlib>, context=64, test=0.02, seed=0)"
    assert bytes(ds.x_train[0][:3]) == open(files[0], "rb").read(3)
    assert data_paths("text", ("<python-stdlib>",), {}, base_dir=".") == files


# ---------------------------------------------------------------------------------------------
# Through the command line: check, run, and nothing of the user's touched

TINY = """
streams { comp1 : compute; comp2 : compute; comp3 : compute; update : update; trans : copy }
model lm(batch = 4, context = 8, width = 8) {
    input x : i32[batch, context]
    input y : i32[batch, context]
    e      = embedding(x, vocab = 128, dim = width)
    h      = pos_embedding(e, context = context)
    n      = layernorm(h)
    q      = linear(n, width)
    k      = linear(n, width) on comp2
    v      = linear(n, width) on comp3
    a      = attention(q, k, v, heads = 2, context = context)
    r      = add(h, a)
    logits = linear(r, 128)
    loss   = token_cross_entropy(logits, y)
}
graph load[a, b] on trans  { copy batch -> x, y }
graph zero_grad  on update { clear grad(lm) }
graph pass       on comp1  { forward lm; backward lm }
graph optimize   on update { adamw(lm, lr, step) }
step train(slot) {
    upload lr on trans
    upload step on trans
    zero_grad
    pass(load[slot])
    load[next]
    optimize
}
train { model = lm; data = DATA; epochs = 1; lr = 0.01 }
"""


def _project(tmp_path, data='text("corpus/*.txt")'):
    (tmp_path / "corpus").mkdir(exist_ok=True)
    (tmp_path / "corpus" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 8)
    p = tmp_path / "lm.sched"
    p.write_text(TINY.replace("DATA", data))
    return str(p)


def test_a_text_model_trains_from_the_command_line_and_reports_bits_per_byte(tmp_path, capsys):
    sched = _project(tmp_path)
    rc, out, err = main(capsys, "check", sched)
    assert rc == 0, err
    before = snapshot(tmp_path)
    rc, out, err = main(capsys, "run", sched, "--backend", "cpu", "--log", tmp_path / "log.jsonl")
    assert rc == 0, err
    assert "bits per byte" in err
    import json

    (rec,) = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert rec["test_bpb"] == pytest.approx(rec["test_loss"] / math.log(2))
    assert math.isfinite(rec["train_loss"]) and rec["step"] == (len("the quick brown fox jumps over the lazy dog\n")
                                                               * 8 - math.ceil(0.1 * 352) - 1) // 8 // 4
    assert_untouched(before, tmp_path, own=("log.jsonl",))
    # the corpus is an input: the run refuses to write its log over it
    rc, out, err = main(capsys, "run", sched, "--backend", "cpu", "-q", "--log", tmp_path / "corpus" / "a.txt")
    assert rc == 1 and code_of(err) == "X021"
    assert_untouched(before, tmp_path, own=("log.jsonl",))


@pytest.mark.parametrize("data,code,words", [
    ('text("corpus/*.md")', "X002", "no file matches"),
    ('text("corpus/a.txt", context = 9)', "X005", "[9]"),
    ('text("<nope>")', "X004", "unknown corpus"),
    ('text("corpus/a.txt", test = 2)', "X004", "strictly between 0 and 1"),
])
def test_text_mistakes_from_the_command_line(tmp_path, capsys, data, code, words):
    sched = _project(tmp_path, data)
    for cmd in (("check",), ("run", "--backend", "cpu", "-q")):
        if cmd == ("check",) and code == "X005":
            continue  # the fit to the model is known once the data is read
        rc, out, err = main(capsys, *cmd, sched)
        assert rc == 1 and code_of(err) == code and words in err, err
    assert sys.exc_info() == (None, None, None)
