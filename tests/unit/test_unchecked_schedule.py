"""tvmgraph's `Schedule` (tvmgraph/schedules/unchecked.py): TVM's schedule without the Python
type checks, whose failing primitives say what failed in one line instead of rendering the
whole function (the rules try primitives that fail, hundreds of times a graph)."""

from __future__ import annotations

import pytest
import tvm
from tvm import s_tir, te

from tvmgraph.schedules.unchecked import Schedule


def two_stages() -> tvm.tirx.PrimFunc:
    a = te.placeholder((64, 64), name="A")
    b = te.compute((64, 64), lambda i, j: a[i, j] + 1.0, name="B")
    c = te.compute((64, 64), lambda i, j: b[i, j] * 2.0, name="C")
    return te.create_prim_func([a, c])


def test_a_failing_primitive_says_what_failed_in_one_line() -> None:
    sch = Schedule(two_stages())
    with pytest.raises(s_tir.ScheduleError) as failed:
        sch.compute_inline(sch.get_sblock("C"))  # the output block cannot be inlined
    assert str(failed.value) == "ScheduleError: Cannot operate on an output block"


def test_the_renderer_can_still_be_chosen() -> None:
    sch = Schedule(two_stages(), error_render_level="detail")
    with pytest.raises(s_tir.ScheduleError) as failed:
        sch.compute_inline(sch.get_sblock("C"))
    assert "The IR with diagnostic is" in str(failed.value)


def test_primitives_do_what_tvms_do() -> None:
    ours, theirs = Schedule(two_stages()), s_tir.Schedule(two_stages())
    for sch in (ours, theirs):
        sch.compute_inline(sch.get_sblock("B"))
        (i, j) = sch.get_loops(sch.get_sblock("C"))
        sch.vectorize(sch.split(j, [None, 8])[1])
    tvm.ir.assert_structural_equal(ours.mod, theirs.mod)
