"""RecomputeSharedLayouts redoes a layout kernel once per element-wise reader, so that FuseOps
fuses it into each (before/after IR on legalized modules; numbers against eager for the
attention it was made for; the time it saves is in docs/benchmarks.md)."""

from __future__ import annotations

import pytest
import torch
import tvm
from torch import nn
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import tvmgraph
from relay_passes.recompute_shared_layouts import RecomputeSharedLayouts
from tests.conftest import SGDStep


def legalized(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` as the pass sees it: legalized, each PrimFunc with its op_pattern."""
    return tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()])(mod)


def kernels_after_fusion(mod: tvm.IRModule) -> list[str]:
    fused = tvm.transform.Sequential([relax.transform.FuseOps(), relax.transform.FuseTIR()])(mod)
    return [b.value.args[0].name_hint for block in fused["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"]


@I.ir_module
class SplitHeads:
    """A packed projection split in three (how torch's MultiheadAttention splits q, k, v)."""

    @R.function
    def main(p: R.Tensor((4, 24), "float32"), w: R.Tensor((8, 8), "float32")):
        with R.dataflow():
            t = R.permute_dims(R.reshape(p, (4, 3, 8)), [1, 0, 2])
            q = R.multiply(R.strided_slice(t, [0], [0], [1]), R.const(0.5, "float32"))
            k = R.strided_slice(t, [0], [1], [2])
            v = R.strided_slice(t, [0], [2], [3])
            s = R.matmul(R.reshape(q, (4, 8)), R.permute_dims(R.reshape(k, (4, 8))))
            out = R.matmul(s, R.reshape(v, (4, 8)))
            R.output(out)
        return out


def test_a_layout_chain_read_by_three_slices_is_redone_in_each() -> None:
    """The reshape and transpose are written out once and read three times before; after, each
    slice has its own copy right before it, and FuseOps makes each chain one kernel."""

    @I.ir_module
    class Expected:
        @R.function
        def main(p: R.Tensor((4, 24), "float32"), w: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                r0 = R.reshape(p, (4, 3, 8))
                t0 = R.permute_dims(r0, [1, 0, 2])
                q = R.multiply(R.strided_slice(t0, [0], [0], [1]), R.const(0.5, "float32"))
                r1 = R.reshape(p, (4, 3, 8))
                t1 = R.permute_dims(r1, [1, 0, 2])
                k = R.strided_slice(t1, [0], [1], [2])
                r2 = R.reshape(p, (4, 3, 8))
                t2 = R.permute_dims(r2, [1, 0, 2])
                v = R.strided_slice(t2, [0], [2], [3])
                s = R.matmul(R.reshape(q, (4, 8)), R.permute_dims(R.reshape(k, (4, 8))))
                out = R.matmul(s, R.reshape(v, (4, 8)))
                R.output(out)
            return out

    before = legalized(SplitHeads)
    messages: list[str] = []
    after = RecomputeSharedLayouts(report=messages.append)(before)
    tvm.ir.assert_structural_equal(after, legalized(Expected))
    # The transpose is read by the three slices (three copies), then the reshape by the three
    # transposes (three more).
    assert messages == ["RecomputeSharedLayouts: layout kernel redone in a reader x6"]
    assert "fused_reshape_transpose" in kernels_after_fusion(before)
    assert len(kernels_after_fusion(before)) == 6
    # Three kernels (each reshape, transpose, slice, ...) and the two matmuls.
    assert len(kernels_after_fusion(after)) == 5


def test_layouts_read_by_a_matmul_a_later_block_or_with_arithmetic_stay() -> None:
    """A matmul reader would not fuse the copy (it would run once per reader); a block output
    is needed as it is; a kernel that computes (exp) is not redone."""

    @I.ir_module
    class Stays:
        @R.function
        def main(x: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                t = R.permute_dims(x)
                a = R.matmul(t, x)
                b = R.add(t, x)
                e = R.exp(x)
                c = R.strided_slice(e, [0], [0], [4])
                d = R.strided_slice(e, [0], [4], [8])
                u = R.permute_dims(x)
                R.output(a, b, c, d, u)
            with R.dataflow():
                f = R.negative(u)
                g = R.strided_slice(u, [0], [0], [4])
                R.output(f, g)
            return (a, b, c, d, f, g)

    before = legalized(Stays)
    tvm.ir.assert_structural_equal(RecomputeSharedLayouts()(before), before)


@pytest.mark.parametrize("training", [False, True], ids=["infer", "train"])
def test_multi_head_attention_matches_eager(training: bool) -> None:
    """torch's MultiheadAttention (packed q/k/v projection, the pattern the pass rewrites):
    outputs, and one SGD step's weights, within 1e-4 of eager's."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(32, 4, batch_first=True)
    reference = nn.MultiheadAttention(32, 4, batch_first=True)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 6, 32)

    class Attend(nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    if not training:
        class Infer(tvmgraph.nn.Graph):
            def __init__(self):
                super().__init__()
                self.m = Attend(model)

            def build(self, x):
                return self.m(x)

        with torch.no_grad():
            torch.testing.assert_close(Infer()(x), Attend(reference)(x), rtol=1e-4, atol=1e-4)
        return

    class Loss(nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.attend = Attend(mha)

        def forward(self, x):
            return self.attend(x).pow(2).sum()

    SGDStep(Loss(model))(x)
    eager_opt = torch.optim.SGD(reference.parameters(), lr=1.0, momentum=0.9)
    Loss(reference)(x).backward()
    eager_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)
