"""ss_gemm_smallk's launch rule (stdlib/kernels/_cuda.py `_smallk_launch_columns`), on the CPU:
the tile narrows only where the widest one leaves SMs idle, and then to the filling width that
wastes the fewest columns, against a brute-force restatement."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from streamsched.stdlib.kernels._cuda import _smallk_columns, _smallk_launch_columns


def _blocks(m: int, n: int, un: int) -> int:
    return -(-m // 32) * -(-n // (32 * un))


def test_the_classifier_gradient_at_batch_128_gets_a_full_grid():
    assert _smallk_columns(1024) == 4
    assert _smallk_launch_columns(128, 1024, 132) == 1  # 32 blocks with un = 4, 128 with 1
    assert _smallk_launch_columns(2048, 1024, 132) == 4  # 512 blocks already
    assert _smallk_launch_columns(256, 1024, 132) == 1  # 64 blocks with un = 4, 128 with 2, 256 with 1
    assert _smallk_launch_columns(512, 1024, 132) == 2  # 128 with 4, 256 with 2

@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 3000), st.integers(1, 200))
def test_the_widest_tile_that_fills_the_sms(m, n, sms):
    got = _smallk_launch_columns(m, n, sms)
    base = _smallk_columns(n)
    assert 1 <= got <= base
    fills = [u for u in range(1, base + 1) if _blocks(m, n, u) >= sms]
    if _blocks(m, n, base) >= sms:
        assert got == base
    else:
        fills = [u for u in fills if u < base]
        waste = {u: -(-n // (32 * u)) * 32 * u - n for u in fills}
        assert got == (min(fills, key=lambda u: (waste[u], -u)) if fills else 1)
