"""The CUDA backend: runs an EventPlan on one GPU, eagerly or as captured CUDA graphs
(docs/cuda.md).  Importing this package imports no CuPy; `DeviceContext` and `CudaExecutor`
import it when constructed.

    DeviceContext(streams)                      streams, cuBLAS handles, events, pinned memory
    CudaExecutor(schedule, plan, kernels=None, capture="none" | "graphs" | "step")
        .run(instrs=None, host_fn=None)         issue instructions (or a compiled Program)
    graph_nodes_edges(graph), captured_dot(graph)   read a captured graph back
"""

from streamsched.interp.cuda.device import (CudaError, DeviceContext, captured_dot, check,
                                            graph_nodes_edges)
from streamsched.interp.cuda.executor import CapturedUnit, CudaExecutor, CudaTaskError, Program



def cuda_available() -> tuple[bool, str]:
    """(True, "") when CuPy, a CUDA device, nvmath-python's cuBLAS bindings and cuda-python's
    runtime bindings are all usable here; else (False, why)."""
    try:
        import cupy
    except Exception as exc:
        return False, f"CuPy is not installed ({exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA driver or device ({exc})"
    if n < 1:
        return False, "no CUDA device"
    try:
        import nvmath.bindings.cublas  # noqa: F401
    except Exception as exc:
        return False, f"nvmath-python is not installed ({exc})"
    try:
        import cuda.bindings.runtime  # noqa: F401
    except Exception as exc:
        return False, f"cuda-python (cuda.bindings) is not installed ({exc})"
    return True, ""


__all__ = ["cuda_available", "CudaError", "DeviceContext", "CudaExecutor", "CudaTaskError", "CapturedUnit",
           "Program", "check", "graph_nodes_edges", "captured_dot"]
