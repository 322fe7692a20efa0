"""streamsched: a declarative scheduling language for GPU training steps, with its interpreter.

A `.sched` file says which work of a training step runs on which CUDA stream; streamsched proves
the schedule race-free, derives the minimal event records and waits, captures the work into CUDA
graphs, and runs the training loop.  See docs/ and LANGUAGE.md.
"""

__version__ = "0.1.0"
