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

__all__ = ["CudaError", "DeviceContext", "CudaExecutor", "CudaTaskError", "CapturedUnit",
           "Program", "check", "graph_nodes_edges", "captured_dot"]
