"""Shared test settings: hypothesis profiles ("ci" when CI is set: more examples, no deadline)
and the --update-golden switch for golden files."""

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files from the current output (review the diff)")


@pytest.fixture(scope="session")
def cp():
    """CuPy on a usable CUDA device with nvmath-python's cuBLAS and cuda-python; else skip.
    Used by every test marked `cuda`."""
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver
        pytest.skip(f"no CUDA device: {exc}")
    if n < 1:
        pytest.skip("no CUDA device")
    pytest.importorskip("nvmath.bindings.cublas")
    pytest.importorskip("cuda.bindings.runtime")
    return cupy


@pytest.fixture(scope="module")
def ctx(cp):
    """A two-stream DeviceContext for kernel tests."""
    from streamsched.interp.cuda import DeviceContext

    c = DeviceContext(["s0", "s1"])
    yield c
    c.close()


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` (full training runs, minutes each) run only when asked for:
    `pytest -m slow`, or STREAMSCHED_SLOW=1; the suite CI runs stays fast."""
    if "slow" in (config.getoption("-m") or "") or os.environ.get("STREAMSCHED_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest -m slow` (or STREAMSCHED_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
