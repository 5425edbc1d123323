"""`Schedule`: TVM's `s_tir.Schedule` without the Python type check on every primitive.

Each schedule primitive of `s_tir.Schedule` is wrapped in `@type_checked`, which binds and
checks every argument against its annotation in Python before the call reaches C++. The rules
make tens of thousands of such calls per training graph: the checks were half the time of
`ApplyCPUSchedules` (1.8 of 3.8 s on the benchmark CNN's training step). The primitives
themselves still validate what they are given (a wrong argument raises from C++).
"""

from __future__ import annotations

from tvm import s_tir


class Schedule(s_tir.Schedule):
    """An `s_tir.Schedule` whose primitives skip the Python-side argument type checks."""


for _name, _attr in vars(s_tir.Schedule).items():
    if callable(_attr) and hasattr(_attr, "__wrapped__"):
        setattr(Schedule, _name, _attr.__wrapped__)
