"""FuseEpilogue groups a matmul/conv2d with its operand transposes and element-wise epilogue."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.fuse_epilogue import FuseEpilogue


@I.ir_module
class Linear:
    """nn.Linear on a 3-D input, GELU, then a residual add: torch.export's shapes, shrunk."""

    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((6, 8), "float32"),
             b: R.Tensor((6,), "float32"), r: R.Tensor((2, 2, 6), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            y = R.matmul(x, wt, out_dtype="float32")
            z = R.add(b, y)
            h = R.reshape(z, R.shape([2, 2, 6]))
            a = R.nn.gelu(h)
            o = R.add(a, r)
            R.output(o)
        return o


def test_linear_gelu_residual_is_one_group() -> None:
    """The weight transpose, bias add, reshape, GELU and residual add all join the matmul
    (FuseOps would stop at the reshape and leave the transpose a kernel of its own)."""

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_permute_dims_relax_matmul_relax_add_relax_reshape_relax_nn_gelu_relax_add(
            w: R.Tensor((6, 8), "float32"), x: R.Tensor((4, 8), "float32"),
            b: R.Tensor((6,), "float32"), r: R.Tensor((2, 2, 6), "float32"),
        ) -> R.Tensor((2, 2, 6), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_epilogue", "Primitive": True})
            with R.dataflow():
                wt = R.permute_dims(w, axes=[1, 0])
                y = R.matmul(x, wt, out_dtype="float32")
                z = R.add(b, y)
                h = R.reshape(z, R.shape([2, 2, 6]))
                a = R.nn.gelu(h)
                gv = R.add(a, r)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((6, 8), "float32"),
                 b: R.Tensor((6,), "float32"), r: R.Tensor((2, 2, 6), "float32")):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_permute_dims_relax_matmul_relax_add_relax_reshape_relax_nn_gelu_relax_add(
                    w, x, b, r)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(FuseEpilogue()(Linear), Expected)


def test_shared_transpose_stays_out_and_conv_takes_bias_and_relu6() -> None:
    """A transpose also used elsewhere is not grouped (and a matmul with nothing else to take
    is left to FuseOps); a conv2d takes its bias add and clip (ReLU6)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((6, 8), "float32"),
                 img: R.Tensor((1, 1, 5, 5), "float32"), k: R.Tensor((6, 1, 3, 3), "float32"),
                 bias: R.Tensor((1, 6, 1, 1), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w, axes=[1, 0])
                y = R.matmul(x, wt)
                s = R.add(y, R.sum(wt))
                c = R.nn.conv2d(img, k)
                cb = R.add(c, bias)
                cr = R.clip(cb, R.prim_value(0.0), R.prim_value(6.0))
                R.output(s, cr)
            return (s, cr)

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_matmul_relax_add(
            x: R.Tensor((4, 8), "float32"), wt: R.Tensor((8, 6), "float32"),
            lv: R.Tensor((), "float32"),
        ) -> R.Tensor((4, 6), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_epilogue", "Primitive": True})
            with R.dataflow():
                y = R.matmul(x, wt)
                gv = R.add(y, lv)
                R.output(gv)
            return gv

        @R.function(private=True)
        def fused_relax_nn_conv2d_relax_add_relax_clip(
            img: R.Tensor((1, 1, 5, 5), "float32"), k: R.Tensor((6, 1, 3, 3), "float32"),
            bias: R.Tensor((1, 6, 1, 1), "float32"),
        ) -> R.Tensor((1, 6, 3, 3), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_epilogue", "Primitive": True})
            with R.dataflow():
                c = R.nn.conv2d(img, k)
                cb = R.add(c, bias)
                gv = R.clip(cb, R.prim_value(0.0), R.prim_value(6.0))
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((6, 8), "float32"),
                 img: R.Tensor((1, 1, 5, 5), "float32"), k: R.Tensor((6, 1, 3, 3), "float32"),
                 bias: R.Tensor((1, 6, 1, 1), "float32")):
            cls = Expected
            with R.dataflow():
                wt = R.permute_dims(w, axes=[1, 0])
                lv = R.sum(wt)
                gv = cls.fused_relax_matmul_relax_add(x, wt, lv)
                gv1 = cls.fused_relax_nn_conv2d_relax_add_relax_clip(img, k, bias)
                R.output(gv, gv1)
            return (gv, gv1)

    tvm.ir.assert_structural_equal(FuseEpilogue()(Before), Expected)


def test_transposed_operands_alone_are_grouped() -> None:
    """A weight gradient dy.T @ x has no epilogue; its transpose still joins the matmul."""

    @I.ir_module
    class Before:
        @R.function
        def main(dy: R.Tensor((4, 6), "float32"), x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                dyt = R.permute_dims(dy, axes=[1, 0])
                dw = R.matmul(dyt, x)
                R.output(dw)
            return dw

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_permute_dims_relax_matmul(
            dy: R.Tensor((4, 6), "float32"), x: R.Tensor((4, 8), "float32")
        ) -> R.Tensor((6, 8), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_epilogue", "Primitive": True})
            with R.dataflow():
                dyt = R.permute_dims(dy, axes=[1, 0])
                gv = R.matmul(dyt, x)
                R.output(gv)
            return gv

        @R.function
        def main(dy: R.Tensor((4, 6), "float32"), x: R.Tensor((4, 8), "float32")):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_permute_dims_relax_matmul(dy, x)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(FuseEpilogue()(Before), Expected)


def test_regrouped_input_of_a_depthwise_weight_gradient_joins_the_conv() -> None:
    """dW of a depthwise conv is a conv over x regrouped to (C*N, 1, H, W): the regrouping
    joins the conv (its kernel then reads x in place) unless something else reads it."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 6, 6), "float32"), dy: R.Tensor((2, 3, 6, 6), "float32")):
            with R.dataflow():
                a = R.reshape(x, R.shape([2, 3, 1, 6, 6]))
                b = R.permute_dims(a, axes=[1, 0, 2, 3, 4])
                c = R.reshape(b, R.shape([6, 1, 6, 6]))
                dw = R.nn.conv2d(c, dy, padding=[1, 1, 1, 1], groups=3, data_layout="CNHW",
                                 kernel_layout="IOHW", out_layout="CNHW")
                d = R.reshape(x, R.shape([2, 3, 1, 6, 6]))
                e = R.permute_dims(d, axes=[1, 0, 2, 3, 4])
                f = R.reshape(e, R.shape([6, 1, 6, 6]))
                dw2 = R.nn.conv2d(f, dy, padding=[1, 1, 1, 1], groups=3, data_layout="CNHW",
                                  kernel_layout="IOHW", out_layout="CNHW")
                R.output(dw, dw2, f)
            return (dw, dw2, f)

    after = FuseEpilogue()(Before)
    groups = {gv.name_hint: func for gv, func in after.functions_items() if gv.name_hint != "main"}
    assert list(groups) == ["fused_relax_reshape_relax_permute_dims_relax_reshape_relax_nn_conv2d"]
    (group,) = groups.values()
    assert [p.name for p in group.params] == ["x", "dy"]
    main = after["main"].script()
    assert "R.nn.conv2d(f, dy" in main  # f is also returned: it stays a tensor of its own


def test_epilogue_that_broadcasts_past_the_product_is_not_taken() -> None:
    """add((4, 6), (3, 4, 6)) makes a bigger tensor: not an epilogue of the (4, 6) product."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 6), "float32"),
                 big: R.Tensor((3, 4, 6), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                o = R.add(y, big)
                R.output(o)
            return o

    tvm.ir.assert_structural_equal(FuseEpilogue()(Before), Before)


def test_reshape_that_splits_the_innermost_axis_stays_out() -> None:
    """A weight gradient as one product, [co, ci * 9] -> [co, ci, 3, 3]: in the group its stores
    go through `j // 9, j // 3 % 3, j % 3`, 16 scalar stores per vector; left out, the reshape is
    a view. A reshape that keeps the innermost axis (nn.Linear on a 3-D input) still joins."""

    @I.ir_module
    class Before:
        @R.function
        def main(dy: R.Tensor((4, 6), "float32"), cols: R.Tensor((18, 6), "float32")):
            with R.dataflow():
                ct = R.permute_dims(cols, axes=[1, 0])
                y = R.matmul(dy, ct)
                dw = R.reshape(y, R.shape([4, 2, 3, 3]))
                R.output(dw)
            return dw

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_permute_dims_relax_matmul(
            cols: R.Tensor((18, 6), "float32"), dy: R.Tensor((4, 6), "float32")
        ) -> R.Tensor((4, 18), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_epilogue", "Primitive": True})
            with R.dataflow():
                ct = R.permute_dims(cols, axes=[1, 0])
                gv = R.matmul(dy, ct)
                R.output(gv)
            return gv

        @R.function
        def main(dy: R.Tensor((4, 6), "float32"), cols: R.Tensor((18, 6), "float32")):
            cls = Expected
            with R.dataflow():
                lv = cls.fused_relax_permute_dims_relax_matmul(cols, dy)
                dw = R.reshape(lv, R.shape([4, 2, 3, 3]))
                R.output(dw)
            return dw

    tvm.ir.assert_structural_equal(FuseEpilogue()(Before), Expected)
    groups = [gv.name_hint for gv, _ in FuseEpilogue()(Linear).functions_items() if gv.name_hint != "main"]
    assert groups == ["fused_relax_permute_dims_relax_matmul_relax_add_relax_reshape_relax_nn_gelu_relax_add"]


def test_chain_stops_where_the_group_would_read_its_own_output() -> None:
    """Two residual layers in a row (`x = x + relu(a(x)); o = x + b(x)`): the first chain ends
    at its residual add, since the second matmul reads that sum and the last add reads the
    second matmul. (A group taking both adds was computed from its own output: `Var ... is
    not defined` at VM codegen.) The second matmul takes the last add."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), wa: R.Tensor((8, 8), "float32"),
                 wb: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                ya = R.matmul(x, wa)
                ra = R.nn.relu(ya)
                x1 = R.add(x, ra)
                yb = R.matmul(x1, wb)
                o = R.add(x1, yb)
                R.output(o)
            return o

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_matmul_relax_add(
            lv: R.Tensor((4, 8), "float32"), wb: R.Tensor((8, 8), "float32"),
        ) -> R.Tensor((4, 8), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_epilogue", "Primitive": True})
            with R.dataflow():
                yb = R.matmul(lv, wb)
                gv = R.add(lv, yb)
                R.output(gv)
            return gv

        @R.function(private=True)
        def fused_relax_matmul_relax_nn_relu_relax_add(
            x: R.Tensor((4, 8), "float32"), wa: R.Tensor((8, 8), "float32"),
        ) -> R.Tensor((4, 8), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_epilogue", "Primitive": True})
            with R.dataflow():
                ya = R.matmul(x, wa)
                ra = R.nn.relu(ya)
                gv = R.add(x, ra)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((4, 8), "float32"), wa: R.Tensor((8, 8), "float32"),
                 wb: R.Tensor((8, 8), "float32")):
            cls = Expected
            with R.dataflow():
                lv = cls.fused_relax_matmul_relax_nn_relu_relax_add(x, wa)
                gv = cls.fused_relax_matmul_relax_add(lv, wb)
                R.output(gv)
            return gv

    tvm.ir.assert_structural_equal(FuseEpilogue()(Before), Expected)


def test_turned_off_it_leaves_the_module_alone() -> None:
    """allow_fuse_add_to_output(False): FuseOps alone will fuse."""
    tvm.ir.assert_structural_equal(FuseEpilogue(enabled=False)(Linear), Linear)


def test_reports_the_groups() -> None:
    messages: list[str] = []
    FuseEpilogue(report=messages.append)(Linear)
    assert messages == ["FuseEpilogue: 1 matmul/conv kernel(s) with their epilogues (6 ops in all)"]


def test_an_epilogue_in_a_later_block_stays_out() -> None:
    """A GELU in the block after its linear layer (a cut of SeparateBackward or
    RecomputeLateReads, which redoes a checkpointed GELU where its gradient reads it): the
    group stops at the block's end. A group across two blocks made FuseOpsByPattern fail
    (`Check failed: defined_vars_.count(var.get())`)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 6), "float32"), b: R.Tensor((6,), "float32")):
            with R.dataflow():
                h = R.matmul(x, w)
                pre = R.add(h, b)
                R.output(pre)
            R.tuple()
            with R.dataflow():
                act = R.nn.gelu(pre)
                R.output(act)
            return act

    after = FuseEpilogue()(Before)
    (fused,) = [f for gv, f in after.functions_items() if gv.name_hint != "main"]
    assert [b.value.op.name for b in fused.body.blocks[0].bindings] == ["relax.matmul", "relax.add"]
    last = [b for b in after["main"].body.blocks if type(b).__name__ == "DataflowBlock"][-1]
    assert [b.value.op.name for b in last.bindings] == ["relax.nn.gelu"]


def test_a_reshape_of_a_value_read_elsewhere_stays_out() -> None:
    """A training step's linear layer: the GELU output `a` is read by the backward pass (the next
    weight gradient) and, reshaped to 2-D, by the next layer. In the group both `a` and its
    reshape were outputs: the same tensor written twice, the copy kept to the backward pass
    (4 MiB a layer in the benchmark transformer's step). The reshape stays out, a view of `a`."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((6, 8), "float32"), b: R.Tensor((6,), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w, axes=[1, 0])
                y = R.matmul(x, wt, out_dtype="float32")
                z = R.add(b, y)
                h = R.reshape(z, R.shape([2, 2, 6]))
                a = R.nn.gelu(h)
                a2 = R.reshape(a, R.shape([4, 6]))
                s = R.sum(a, axis=[0, 1])
                o = R.add(a2, a2)
                R.output(o, s)
            return (o, s)

    after = FuseEpilogue()(Before)
    (fused,) = [f for gv, f in after.functions_items() if gv.name_hint != "main"]
    ops = [b.value.op.name for blk in fused.body.blocks for b in blk.bindings if isinstance(b.value.op, tvm.ir.Op)]
    assert ops == ["relax.permute_dims", "relax.matmul", "relax.add", "relax.reshape", "relax.nn.gelu"]
    outputs = fused.body.body
    assert not isinstance(outputs, tvm.relax.Tuple) or len(outputs.fields) == 1
    main_ops = [b.value.op.name for blk in after["main"].body.blocks for b in blk.bindings
                if isinstance(b.value, tvm.relax.Call) and isinstance(b.value.op, tvm.ir.Op)]
    assert main_ops.count("relax.reshape") == 1  # a2, outside the group


def _group_ops(after: tvm.IRModule) -> list[str]:
    (fused,) = [f for gv, f in after.functions_items() if gv.name_hint != "main"]
    return [b.value.op.name for blk in fused.body.blocks for b in blk.bindings if isinstance(b.value.op, tvm.ir.Op)]


def test_a_silu_joins_the_conv() -> None:
    """nn.SiLU as torch.export writes it, `h * sigmoid(h)`: the sigmoid and the product join the
    group (a U-Net's convolutions; left out, a kernel of its own read the conv's output again)."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32"),
                 b: R.Tensor((1, 4, 1, 1), "float32")):
            with R.dataflow():
                y = R.nn.conv2d(x, w, padding=[1, 1, 1, 1])
                h = R.add(y, b)
                s = R.sigmoid(h)
                o = R.multiply(h, s)
                R.output(o)
            return o

    after = FuseEpilogue()(Before)
    assert _group_ops(after) == ["relax.nn.conv2d", "relax.add", "relax.sigmoid", "relax.multiply"]
    (call,) = [b.value for blk in after["main"].body.blocks for b in blk.bindings]
    assert isinstance(call.op, tvm.ir.GlobalVar)  # main calls the group alone


def test_a_gate_by_another_tensors_sigmoid_stays_out() -> None:
    """`h * sigmoid(g)`, g another tensor (a GLU's gate): no SiLU, and a product of two
    activations, which the schedules do not compute in the epilogue."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 6), "float32"), g: R.Tensor((4, 6), "float32")):
            with R.dataflow():
                h = R.matmul(x, w)
                s = R.sigmoid(g)
                o = R.multiply(h, s)
                R.output(o)
            return o

    tvm.ir.assert_structural_equal(FuseEpilogue()(Before), Before)
