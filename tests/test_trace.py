"""The stream timeline (`streamsched.interp.cuda.trace`): the Chrome trace, the summary and the
picture from plain records on any machine; the traced run itself on a GPU (marker `cuda`)."""

from __future__ import annotations

import json
import os

import pytest

from streamsched.interp.cuda.trace import category, chrome_trace, plot_timeline, short_label, summarize

ROOT = os.path.join(os.path.dirname(__file__), "..")
STREAMS = ("trans", "comp1", "comp2", "comp3", "update")


def _records():
    """Two steps of a made-up backward: dW, dB, dX of `logits` overlapping on three streams."""
    out = []
    for step in (1, 2):
        out += [
            {"step": step, "stream": "comp1", "label": "pass[b]: linear@logits", "kernel": "matmul",
             "task": 1, "start_us": 0.0, "end_us": 10.0},
            {"step": step, "stream": "comp1", "label": "pass[b]: linear.backward@logits.dw",
             "kernel": "matmul", "task": 2, "start_us": 12.0, "end_us": 20.0},
            {"step": step, "stream": "comp2", "label": "pass[b]: linear.backward@logits.db",
             "kernel": "sum", "task": 3, "start_us": 12.5, "end_us": 15.0},
            {"step": step, "stream": "comp3", "label": "pass[b]: linear.backward@logits.dx",
             "kernel": "matmul", "task": 4, "start_us": 13.0, "end_us": 22.0},
            {"step": step, "stream": "update", "label": "optimize: sgd@logits.w.w", "kernel": "sgd_step",
             "task": 5, "start_us": 23.0, "end_us": 25.0},
        ]
    return out


def test_chrome_trace_has_one_track_per_stream_and_named_events():
    recs = _records()
    host = [{"step": 1, "stream": "host", "label": "upload.lr: set lr", "kernel": "set_scalar",
             "start_us": 0.0, "end_us": 1.5}]
    tr = chrome_trace(recs, STREAMS, host, meta={"gate": True})
    json.dumps(tr)  # serialisable
    ev = tr["traceEvents"]
    names = {e["args"]["name"] for e in ev if e.get("name") == "thread_name" and e["pid"] == 0}
    assert names == set(STREAMS)
    tid = {e["args"]["name"]: e["tid"] for e in ev if e.get("name") == "thread_name" and e["pid"] == 0}
    xs = [e for e in ev if e["ph"] == "X" and e["pid"] == 0]
    assert len(xs) == len(recs)
    dw = [e for e in xs if e["name"].endswith("logits.dw")]
    assert len(dw) == 2 and all(e["tid"] == tid["comp1"] for e in dw)
    assert dw[0]["dur"] == pytest.approx(8.0)
    # the second step is laid after the first (span 25 us + 20 us gap)
    assert sorted(e["ts"] for e in dw) == [pytest.approx(12.0), pytest.approx(12.0 + 45.0)]
    hx = [e for e in ev if e["ph"] == "X" and e["pid"] == 1]
    assert [e["name"] for e in hx] == ["upload.lr: set lr"]
    assert tr["otherData"]["gate"] is True


def test_summary_measures_the_fork_overlap():
    s = summarize(_records())
    st = s["steps"]["2"]
    assert st["span_us"] == pytest.approx(25.0)
    assert st["busy_us"]["comp1"] == pytest.approx(18.0)
    ov = st["fork_overlap_us"]["logits"]
    assert ov["db|dw"] == pytest.approx(2.5)
    assert ov["dw|dx"] == pytest.approx(7.0)
    assert ov["db|dx"] == pytest.approx(2.0)


def test_labels_and_categories():
    assert short_label("pass[b]: linear.backward@h2.dx", "matmul") == "h2.dx"
    assert short_label("pass[b]: linear@h1", "matmul") == "matmul h1"
    assert short_label("", "fill") == "fill"
    assert category("matmul") == "gemm" and category("sum") == "reduce"
    assert category("h2d") == "copy" and category("sgd_step") == "optimizer"
    assert category("softmax_xent_grad") == "loss" and category("relu_grad") == "elementwise"


def test_plot_timeline_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = plot_timeline(_records(), STREAMS, str(tmp_path / "t.png"), title="made up")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        plot_timeline([], STREAMS, str(tmp_path / "u.png"))


@pytest.mark.cuda
def test_trace_five_streams_on_the_gpu(tmp_path):
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:
        pytest.skip(f"no CUDA device: {exc}")
    pytest.importorskip("nvmath.bindings.cublas")
    from streamsched.interp.cuda.trace import trace
    from streamsched.pipeline import compile_file

    c = compile_file(os.path.join(ROOT, "examples", "five_streams.sched"))
    out = str(tmp_path / "trace.json")
    res = trace(c, out, png=str(tmp_path / "t.png"), steps=2)
    with open(out, encoding="utf-8") as f:
        tr = json.load(f)
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    n_dev = sum(1 for t in c.schedule.tasks if t.stream != "host" and t.step == c.schedule.steps - 1)
    assert len(xs) >= n_dev  # every device task of both traced steps
    assert all(e["dur"] >= 0 for e in xs)
    assert any(e["name"].endswith("logits.dw") for e in xs)
    st = res["summary"]["steps"]["2"]
    assert set(st["busy_us"]) <= set(c.schedule.streams)
    assert "logits" in st["fork_overlap_us"]
