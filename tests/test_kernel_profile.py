"""benchmarks/kernel_profile.py's pure part: the per-kernel table from Chrome-trace events,
recomputed here by hand (the GPU part is exercised by `step_time.py --profile-dir` on the GPU)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from kernel_profile import kernel_table  # noqa: E402


def test_kernel_table_counts_only_kernels_and_sorts_by_time():
    ev = [{"cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 4.0},
          {"cat": "kernel", "name": "add", "ts": 1.0, "dur": 1.0},
          {"cat": "kernel", "name": "gemm", "ts": 10.0, "dur": 6.0},
          {"cat": "kernel", "name": "add", "ts": 12.0, "dur": 1.5},
          {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 99.0},
          {"cat": "kernel", "name": "no_duration", "ts": 3.0}]
    t = kernel_table(ev, steps=2)
    assert [r["kernel"] for r in t["kernels"]] == ["gemm", "add"]
    assert t["kernels"][0] == {"kernel": "gemm", "launches_per_step": 1.0, "us_per_step": 5.0, "us_per_launch": 5.0}
    assert t["kernels"][1] == {"kernel": "add", "launches_per_step": 1.0, "us_per_step": 1.25, "us_per_launch": 1.25}
    assert t["kernels_per_step"] == 2.0 and t["busy_us_per_step"] == 6.25
    assert t["span_us_per_step"] == (16.0 - 0.0) / 2  # first start to last end, per step


def test_kernel_table_of_nothing():
    t = kernel_table([], steps=20)
    assert t["kernels"] == [] and t["kernels_per_step"] == 0 and t["span_us_per_step"] == 0.0


def test_timeline_keeps_the_last_steps_in_start_order_with_their_streams():
    from kernel_profile import timeline

    ev = [{"cat": "kernel", "name": n, "ts": ts, "dur": 2.0, "args": {"stream": s}}
          for n, ts, s in [("a", 10.0, 7), ("b", 11.0, 8), ("a", 30.0, 7), ("b", 31.5, 8), ("a", 50.0, 7), ("b", 50.5, 8)]]
    ev.append({"cat": "cpu_op", "name": "x", "ts": 0.0, "dur": 1.0})
    rows = timeline(list(reversed(ev)), steps=3, keep=2)
    assert rows == [[0.0, 2.0, 7, "a"], [1.5, 2.0, 8, "b"], [20.0, 2.0, 7, "a"], [20.5, 2.0, 8, "b"]]
    assert timeline([], steps=3) == []
