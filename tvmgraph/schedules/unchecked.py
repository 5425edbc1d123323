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
    """An `s_tir.Schedule` whose primitives skip the Python-side argument type checks, and
    whose errors are rendered briefly."""

    def __init__(self, mod, *, error_render_level: str = "fast", **kwargs) -> None:
        # NOTE: the rules try primitives that may fail (compute_inline on each block, say) and
        # go on. A failure cost 0.2 ms at TVM's default ("detail"), 0.06 ms here: 1300 of them
        # were a third of the scheduling time of the benchmark CNN's training step.
        super().__init__(mod, error_render_level=error_render_level, **kwargs)


# NOTE: not what Schedule defines itself: `__init__` is type-checked too, and taking TVM's
# unwrapped one here silently undid the "fast" default above (every failing primitive rendered
# the whole function: 1-1.5 ms each, 0.9 s of CPU in the benchmark CNN's training compile).
for _name, _attr in vars(s_tir.Schedule).items():
    if _name not in vars(Schedule) and callable(_attr) and hasattr(_attr, "__wrapped__"):
        setattr(Schedule, _name, _attr.__wrapped__)
