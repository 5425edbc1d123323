"""The default CPU schedules (tvmgraph.schedules) compute what torch computes, and schedule.

Each rule gets small workloads in the shapes our models produce; every test compiles with
`ApplyCPUSchedules` at the pipeline position of tvmgraph's default pipeline, runs on the llvm
host target, compares with torch, and checks that the kernel was scheduled by the expected
rule (a parallel or vectorized loop in the scheduled TIR, the rule's own `apply` matching).

Tolerances: float32 results whose reduction order differs from torch's (matmul, conv,
reductions) use atol = rtol = 1e-4 relative to values of order 1-10; the fast-math rewrite is
held to the accuracy its module docstring states.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from torch import nn
from tvm import relax, te, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.target import Target

from tests.conftest import TrainGraph
from tests.models import EncoderBlock, SmallCNN
from tvmgraph.schedules import (
    ApplyCPUSchedules,
    ApplyGPUSchedules,
    Conv2d,
    ConvWeightGradient,
    Elementwise,
    Fallback,
    Matmul,
    MatrixVector,
    Reduction,
)
from tvmgraph.schedules.fast_math import fast_erf, fast_exp, fast_sigmoid, fast_tanh, use_fast_math
from tvmgraph.schedules.loops import MIN_PARALLEL_ELEMENTS
from tvmgraph.schedules.cpu_target import CPUTarget
from tvmgraph.schedules.matmul import ROW_STEP, choose_tile, swaps_on
from tvmgraph.schedules.reduction import CHANNELS_PER_THREAD, ROW_CHAINS

TARGET = tvm.target.Target(
    {"kind": "llvm", "mcpu": tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")()}
)
TOL = dict(atol=1e-4, rtol=1e-4)


# ---- helpers ---------------------------------------------------------------------------------


def fuse(mod: tvm.IRModule, *extra: tvm.transform.Pass) -> tvm.IRModule:
    """tvmgraph's default pipeline up to the point where ApplyCPUSchedules runs."""
    T = relax.transform
    passes = [*extra, relax.backend.DispatchSampling(), relax.backend.DispatchSortScan(),
              T.LegalizeOps(), T.AnnotateTIROpPattern(), T.FoldConstant(), T.FuseOps(),
              T.FuseTIR()]
    with TARGET:
        return tvm.transform.Sequential(passes)(mod)


def finish(mod: tvm.IRModule) -> tvm.runtime.Executable:
    """The rest of tvmgraph's default pipeline, then code generation."""
    T = relax.transform
    passes = [T.RewriteDataflowReshape(), T.ToNonDataflow(), T.RemovePurityChecking(),
              T.CallTIRRewrite(), T.StaticPlanBlockMemory(), T.LowerAllocTensor(),
              T.KillAfterLastUse(), T.LowerRuntimeBuiltin(), T.ComputePrimValue(),
              T.VMShapeLower(), T.AttachGlobalSymbol()]
    with TARGET:
        mod = tvm.transform.Sequential(passes)(mod)
    return tvm.compile(mod, target=TARGET, relax_pipeline=None)


def run_relax(mod: tvm.IRModule, *inputs: torch.Tensor,
              extra: tuple[tvm.transform.Pass, ...] = ()) -> tuple[torch.Tensor | list[torch.Tensor], tvm.IRModule]:
    """Compile `mod` with the CPU schedules, run main; returns (output, or the list of outputs
    of a tuple result, and the scheduled module)."""
    with TARGET:
        scheduled = ApplyCPUSchedules()(fuse(mod, *extra))
    vm = relax.VirtualMachine(finish(scheduled), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x.numpy()) for x in inputs])
    if hasattr(out, "numpy"):
        return torch.from_numpy(out.numpy()), scheduled
    return [torch.from_numpy(o.numpy()) for o in out], scheduled


def run_prim_func(func: tirx.PrimFunc, *inputs: torch.Tensor,
                  out_shape: tuple[int, ...]) -> tuple[torch.Tensor, tirx.PrimFunc]:
    """Schedule a lone PrimFunc whose last parameter is its output, build and run it."""
    with TARGET:
        mod = ApplyCPUSchedules()(tvm.IRModule({"main": func}))
    lib = tvm.compile(mod, target=TARGET)
    args = [tvm.runtime.tensor(x.numpy()) for x in inputs]
    out = tvm.runtime.tensor(np.zeros(out_shape, "float32"))
    lib["main"](*args, out)
    return torch.from_numpy(out.numpy()), mod["main"]


def prim_funcs(mod: tvm.IRModule) -> dict[str, tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def assert_scheduled(func: tirx.PrimFunc, *, parallel: bool = True, vector: bool = True) -> None:
    """The function carries the scheduled mark and the loop kinds a CPU schedule gives."""
    assert bool(func.attrs["tirx.is_scheduled"]), "function was not scheduled"
    text = func.script()
    if parallel:
        assert "T.parallel(" in text, "no parallel loop"
    if vector:
        assert "T.vectorized(" in text, "no vectorized loop"


def unscheduled(mod: tvm.IRModule, name_part: str) -> tirx.PrimFunc:
    """The fused, not yet scheduled PrimFunc whose name contains `name_part`."""
    matches = [f for name, f in prim_funcs(mod).items() if name_part in name]
    assert len(matches) == 1, f"{name_part!r} matches {sorted(prim_funcs(mod))}"
    return matches[0]


def te_matmul(m: int, n: int, k: int, a_trans: bool, b_trans: bool,
              batch: int = 0) -> tirx.PrimFunc:
    """relu(A @ B + bias) with A/B stored transposed on request (as autodiff emits them)."""
    lead = (batch,) if batch else ()
    a = te.placeholder((*lead, k, m) if a_trans else (*lead, m, k), name="A")
    b = te.placeholder((*lead, n, k) if b_trans else (*lead, k, n), name="B")
    bias = te.placeholder((n,), name="bias")
    r = te.reduce_axis((0, k), name="k")

    def at(t: te.Tensor, i: tirx.PrimExpr, j: tirx.PrimExpr, trans: bool, s: tuple) -> tirx.PrimExpr:
        return t[(*s, j, i)] if trans else t[(*s, i, j)]

    c = te.compute(
        (*lead, m, n),
        lambda *idx: te.sum(at(a, idx[-2], r, a_trans, idx[:-2]) * at(b, r, idx[-1], b_trans, idx[:-2]),
                            axis=r),
        name="matmul",
    )
    out = te.compute(c.shape, lambda *idx: te.max(c[idx] + bias[idx[-1]], 0.0), name="epilogue")
    return te.create_prim_func([a, b, bias, out])


# ---- matmul.py -------------------------------------------------------------------------------

MATMULS = {
    # id: (m, n, k, a_trans, b_trans, batch)
    "nn": (48, 64, 96, False, False, 0),
    "nt-x-wT": (32, 80, 64, False, True, 0),
    "tn-dW-from-dyT-x": (64, 48, 40, True, False, 0),
    "batched-attention-qkT": (32, 32, 16, False, True, 4),
    "ragged-needs-padding": (7, 10, 33, False, False, 0),
    "matrix-vector": (1, 96, 80, False, False, 0),
    "attention-p-v-65-tokens": (65, 32, 65, False, False, 4),
}


@pytest.mark.parametrize("case", MATMULS.values(), ids=MATMULS.keys())
def test_matmul_rule_matches_torch(case: tuple) -> None:
    """Matmul with bias+ReLU epilogue, in every operand layout, is register-tiled and exact."""
    m, n, k, a_trans, b_trans, batch = case
    lead = (batch,) if batch else ()
    a = torch.randn(*lead, *((k, m) if a_trans else (m, k)))
    b = torch.randn(*lead, *((n, k) if b_trans else (k, n)))
    bias = torch.randn(n)
    func = te_matmul(m, n, k, a_trans, b_trans, batch)
    assert Matmul().apply(func, TARGET, False) is not None
    out, scheduled = run_prim_func(func, a, b, bias, out_shape=(*lead, m, n))
    a_ = a.transpose(-1, -2) if a_trans else a
    b_ = b.transpose(-1, -2) if b_trans else b
    torch.testing.assert_close(out, torch.relu(a_ @ b_ + bias), **TOL)
    assert_scheduled(scheduled, parallel=m * n * k >= 1 << 18)
    assert "T.unroll(" in scheduled.script(), "no register tile"


@pytest.mark.parametrize("n, panel_major", [(768, True), (80, False)])
def test_matmul_packs_b_panel_by_panel_when_there_are_enough_panels(monkeypatch: pytest.MonkeyPatch, n: int,
                                                                     panel_major: bool) -> None:
    """x @ W.T packs W. Before (few panels, n=80): all of W is packed in a loop of its own, then
    the tiles run. After (n=768: 16 panels for 2 threads): the packing block sits inside the
    parallel loop over panels, so each panel is packed right before its tiles read it and the
    packing workspace is one panel, not all of W."""
    from tvmgraph.schedules import matmul

    monkeypatch.setattr(matmul.os, "cpu_count", lambda: 2)
    m, k = 64, 96
    func = te_matmul(m, n, k, False, True)
    a, b, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    out, scheduled = run_prim_func(func, a, b, bias, out_shape=(m, n))
    torch.testing.assert_close(out, torch.relu(a @ b.T + bias), **TOL)
    text = scheduled.script()
    pack, tiles = text.index('T.sblock("B_'), text.index('T.sblock("matmul_update')
    first_parallel = text.index("T.parallel(")
    assert (first_parallel < pack < tiles) is panel_major, text[:3000]


@pytest.mark.parametrize("m, n, k, row_blocks", [
    (1030, 160, 600, True),  # A 2.4 MiB, taller than B (in L2); I and J padded to whole tiles
    (1024, 256, 256, False),  # A 1 MiB: panels outermost
    (256, 1024, 2048, False),  # B taller than A
    # ResNet-18's layer-4 product: A 9.4 MB, but blocks of 8 rows would reread all of B
    # (4.7 MB, beyond L2) 64 times: 302 MB against 75 MB for A once per panel.
    (512, 256, 4608, False),
    (4096, 256, 1024, True),  # a GPT's tied embedding: B (1 MB) 64 times, A (16 MB) 8 times
])
def test_a_tall_operand_too_big_for_l2_is_read_in_blocks_of_rows(monkeypatch: pytest.MonkeyPatch, m: int, n: int,
                                                                  k: int, row_blocks: bool) -> None:
    """A weight gradient x.T @ dy over many rows of x (a GPT's tied embedding: 4096 x 256 summed
    over 1024 tokens): with B's panels outermost, every panel read all of A from L3. From
    ROW_BLOCK_MIN_A_BYTES of A, when A is taller than B, the parallel loop runs over blocks of
    A's rows instead, each block's tiles meeting every panel of B in turn: loops
    parallel(blocks) > panels > the block's tiles > K > tile. Matches torch either way."""
    from tvmgraph.schedules import matmul

    monkeypatch.setattr(matmul.os, "cpu_count", lambda: 2)
    func = te_matmul(m, n, k, True, False)
    a, b, bias = torch.randn(k, m) / k ** 0.5, torch.randn(k, n), torch.randn(n)  # sums of O(1)
    out, _ = run_prim_func(func, a, b, bias, out_shape=(m, n))
    torch.testing.assert_close(out, torch.relu(a.T @ b + bias), **TOL)
    sch = Matmul().apply(func, TARGET, False)
    extents = [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock("matmul_update"))]
    kinds = [sch.get(loop).kind for loop in sch.get_loops(sch.get_sblock("matmul_update"))]
    assert kinds[0] == tirx.ForKind.PARALLEL
    if row_blocks:
        blocks, panels, tiles, _, mi, nvec, lanes = extents
        assert blocks * tiles * mi >= m > (blocks * tiles - 1) * mi and blocks >= 8, extents
        assert panels == -(-n // (nvec * lanes)), extents
    else:
        assert len(extents) < 7, extents


@pytest.mark.parametrize("m, n, k, rows_outer", [
    (1040, 128, 128, True),    # a ViT's attention output projection
    (1040, 128, 256, True),    # its second MLP layer
    (2048, 96, 128, True),     # three panels of 32
    (128, 256, 64, False),     # B wider than A is tall
    (1024, 768, 256, False),   # B (768 KiB) past L2
])
def test_a_tall_a_meets_a_small_b_by_bands_of_rows(monkeypatch: pytest.MonkeyPatch, m: int, n: int, k: int,
                                                   rows_outer: bool) -> None:
    """x @ W.T with B packed whole: the parallel loop runs over (row tiles, panels) when A is
    taller than B is wide and B fits L2 (each thread then reads a band of A's rows, the band the
    kernel before left in its L2), else over (panels, row tiles). Matches torch either way."""
    from tvmgraph.schedules import matmul

    monkeypatch.setattr(matmul.os, "cpu_count", lambda: 2)
    func = te_matmul(m, n, k, False, True)
    a, b, bias = torch.randn(m, k) / k ** 0.5, torch.randn(n, k), torch.randn(n)
    out, _ = run_prim_func(func, a, b, bias, out_shape=(m, n))
    torch.testing.assert_close(out, torch.relu(a @ b.T + bias), **TOL)
    # Scheduled for a fixed AVX-512 core (the tiles, and so the panels, depend on the CPU).
    sch = Matmul().apply(func, tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"}), False)
    parallel = sch.get(sch.get_loops(sch.get_sblock("matmul_update"))[0])
    assert parallel.kind == tirx.ForKind.PARALLEL
    lines = sch.mod["main"].script().splitlines()
    update = next(i for i, line in enumerate(lines) if 'T.sblock("matmul_update")' in line)
    row = next(line for line in lines[update:] if f"v1 = T.axis.spatial({m}," in line)
    # Rows outermost: a tile's first row is the parallel index over the panels, times the
    # tile's rows; panels outermost: the parallel index modulo the row tiles, times them.
    assert (f"{parallel.loop_var.name} // " in row) is rows_outer, row


@pytest.mark.parametrize("mcpu, m, packed", [
    ("znver5", 64, False), ("znver5", 96, True), ("znver5", 256, True),
    ("znver3", 8, False), ("znver3", 16, True), ("znver3", 64, True),
    ("sapphirerapids", 16, False), ("sapphirerapids", 32, True), ("rocketlake", 64, True),
])
def test_matmul_packs_a_b_contiguous_along_j_that_many_rows_reread(mcpu: str, m: int, packed: bool) -> None:
    """x @ W with W[k, n] read in place by few rows; from CPUTarget.pack_reused_rows rows of x on
    (96 on Zen 5, 16 on Zen 3 with its 16 registers, 32 on Intel cores), each panel of W is
    first copied contiguous (on Zen 5 the large MLP's input gradient: 0.80x the time; on
    Sapphire Rapids the batch-64 MLP's: 0.53x; on Zen 3 64 x 1024 x 1024: 0.37x).
    The schedule is decided for `mcpu`; the result is checked on this machine's CPU."""
    n, k = 768, 64  # a multiple of every tile width: no padding, which would pack B anyway
    func = te_matmul(m, n, k, False, False)
    with tvm.target.Target({"kind": "llvm", "mcpu": mcpu}):
        scheduled = ApplyCPUSchedules()(tvm.IRModule({"main": func}))["main"]
    assert ('T.sblock("B_' in scheduled.script()) is packed
    a, b, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    out, _ = run_prim_func(func, a, b, bias, out_shape=(m, n))
    torch.testing.assert_close(out, torch.relu(a @ b + bias), **TOL)


def _store_vector_runs_along_rows(text: str) -> bool:
    """Whether the epilogue's vectorized loop indexes the output's last (contiguous) axis."""
    at = text.rindex("T.vectorized(")
    loop = re.findall(r"for (\w+) in T\.vectorized", text[:at + 14])[-1]
    store = text[at:]
    last_index = re.search(r"epilogue\[\w+, (\w+)\] =", store).group(1)
    return re.search(rf"{last_index} = T\.axis\.spatial\([^\n]*\b{loop}\b", store) is not None


@pytest.mark.parametrize("m, n, k, packed", [
    (64, 1024, 1024, "A"), (48, 1024, 512, "A"), (32, 512, 512, "A"),
    (16, 1024, 1024, None),  # the MatrixVector rule's dot products: as fast with a W of 4 MiB
    (16, 2048, 2048, "A"),  # ... not with 16 MiB
    (64, 256, 1024, "B"),  # 4 rows of W per row of x, and W in L2: its copy costs little
    (128, 2048, 1024, "B"),  # rows enough to pay for packing W
    (8, 1024, 1024, None),  # fewer rows than a vector's lanes: the MatrixVector rule's
])
def test_few_rows_of_x_against_a_large_w_run_as_w_at_x_t(m: int, n: int, k: int, packed: str | None) -> None:
    """relu(x @ W.T + b). Before: every call packs W into panels (a transposing copy of all of
    W, a third of a 64 x 1024 x 1024 product on Sapphire Rapids) and the tiles broadcast x.
    After, for 16 to 64 rows of x against a W of 1 MiB or more (8 MiB under 32 rows) with 16
    rows of W per row of x: the operands swap roles (C.T = W @ x.T), W is read in place, x is
    packed, and the store's vectors still run along the output's rows (along the tile's I, not
    its J). Decided for Sapphire Rapids (Intel, 32 vector registers; Zen 5 keeps packing W); the
    numbers are checked on this machine's CPU, whose own decision is checked as well."""
    func = te_matmul(m, n, k, False, True)
    with Target({"kind": "llvm", "mcpu": "sapphirerapids"}):
        scheduled = ApplyCPUSchedules()(tvm.IRModule({"main": func}))["main"]
    text = scheduled.script()
    assert ('T.sblock("A_' in text, 'T.sblock("B_' in text) == (packed == "A", packed == "B"), text[:2500]
    if packed is not None:
        assert _store_vector_runs_along_rows(text), text[-1500:]
    x, w, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    out, here = run_prim_func(func, x, w, bias, out_shape=(m, n))
    torch.testing.assert_close(out, torch.relu(x @ w.T + bias), **TOL)
    assert ('T.sblock("A_' in here.script()) is (packed == "A" and swaps_on(CPUTarget.from_target(TARGET)))
    with Target({"kind": "llvm", "mcpu": "znver5"}):  # measured slower on Zen 5: not swapped
        zen = ApplyCPUSchedules()(tvm.IRModule({"main": func}))["main"].script()
    assert 'T.sblock("A_global"' not in zen  # x's panels (a padded A is "A_reindex_pad")


@pytest.mark.parametrize("m, n, k, casts", [
    (256, 256, 256, 0),
    (7, 96, 80, 0),  # A's zero-padded copy widened
    (64, 1024, 512, 1),  # on Intel x @ W.T swaps: W, as A, is read by 2 panels of x, in place
])
def test_bfloat16_operands_are_widened_in_their_copies_not_in_the_fma_loop(m: int, n: int, k: int,
                                                                           casts: int) -> None:
    """AMP's product: bfloat16 x and W summed in float32. Before, the update multiplied
    `Cast("float32", x[..]) * Cast("float32", W_panel[..])`, widening every broadcast and panel
    vector inside the FMA loop (46-56% of the FMA peak on Sapphire Rapids, float32 67-71%).
    After, B's panels are float32, and so is A's copy where 4 panels or more reread A
    (WIDEN_A_MIN_PANELS); the update reads them as they are. The result is torch's float32
    product of the bfloat16 values."""
    x = te.placeholder((m, k), name="x", dtype="bfloat16")
    w = te.placeholder((n, k), name="w", dtype="bfloat16")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(x[i, r].astype("float32") * w[j, r].astype("float32"), axis=r),
                   name="matmul")
    func = te.create_prim_func([x, w, c])
    with TARGET:
        scheduled = ApplyCPUSchedules()(tvm.IRModule({"main": func}))["main"]
    after_update = scheduled.script().split('T.sblock("matmul_update")')[1]
    update = next(line for line in after_update.splitlines() if "] = " in line)  # the multiply-add
    assert " + " in update and " * " in update, update
    expected = casts if swaps_on(CPUTarget.from_target(TARGET)) or casts == 0 else 0
    assert update.count("T.Cast(") <= expected, update
    xs, ws = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    lib = tvm.compile(tvm.IRModule({"main": scheduled}), target=TARGET)
    out = tvm.runtime.tensor(np.zeros((m, n), "float32"))
    lib["main"](*(tvm.runtime.tensor(t.float().numpy().astype(ml_dtypes.bfloat16)) for t in (xs, ws)), out)
    torch.testing.assert_close(torch.from_numpy(out.numpy()), xs.float() @ ws.float().T, **TOL)


@pytest.mark.parametrize("lead", [(32,), (2, 16)], ids=["2-D", "3-D"])
def test_swapped_operands_keep_the_epilogue_on_the_output_indices(lead: tuple[int, ...]) -> None:
    """A residual add, a GELU and a scale after x @ W.T (operands swapped; x 2-D, or 3-D whose
    two leading axes fuse into the product's rows): the epilogue reads its other operands at
    the output's own indices, not the tile's transposed ones."""
    n, k = 1024, 512
    x = relax.Var("x", relax.TensorType((*lead, k), "float32"))
    w = relax.Var("w", relax.TensorType((n, k), "float32"))
    r = relax.Var("r", relax.TensorType((*lead, n), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w, r]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            z = bb.emit(relax.op.nn.gelu(relax.op.add(y, r)))
            out = bb.emit_output(relax.op.multiply(z, relax.const(0.5, "float32")))
        bb.emit_func_output(out)
    xs, ws, rs = torch.randn(*lead, k), torch.randn(n, k), torch.randn(*lead, n)
    out, scheduled = run_relax(bb.get(), xs, ws, rs, extra=(relax.transform.FuseTransposeMatmul(),))
    torch.testing.assert_close(out, torch.nn.functional.gelu(xs @ ws.T + rs) * 0.5, **TOL)
    if swaps_on(CPUTarget.from_target(TARGET)):  # swapped here: x is packed
        kernels = [f.script() for f in prim_funcs(scheduled).values()]
        assert any('T.sblock("x_' in text for text in kernels), kernels


def test_padded_rows_of_a_product_stored_through_a_reshape_stay_out_of_the_output() -> None:
    """C[n, (b, t)] = A[n, :] @ B[:, (b, t)] with 3 rows, padded to the 4-row tile, stored as
    out[b * 3 + n, t] (a 3-D adaptive average pool's gradient, one axis at a time). Inlined
    into the tile's store, the padded row n = 3 passed the bound test of the reshaped index
    (b * 3 + 3 < 72) and overwrote row 0 of batch b + 1 with zeros. Matches numpy."""
    n, k, batches, t = 3, 2, 24, 4
    a = te.placeholder((n, k), name="A")
    b = te.placeholder((k, batches * t), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((n, batches * t), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="matmul")
    out = te.compute((batches * n, t), lambda row, col: c[row % n, row // n * t + col], name="reshape")
    func = te.create_prim_func([a, b, out])
    with tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"}):
        scheduled = ApplyCPUSchedules()(tvm.IRModule({"main": func}))["main"]
    assert "T.unroll(" in scheduled.script(), "not register-tiled: the case is not exercised"
    x, y = torch.randn(n, k), torch.randn(k, batches * t)
    got, _ = run_prim_func(func, x, y, out_shape=(batches * n, t))
    want = (x @ y).reshape(n, batches, t).permute(1, 0, 2).reshape(batches * n, t)
    torch.testing.assert_close(got, want, **TOL)


def test_a_reshape_reading_a_padded_axis_through_a_modulo_is_fused_into_the_store() -> None:
    """Legalized, `reshape(x @ W.T, (2, 120, n))` reads the product at
    `[(b * 120 + v // n + t) % 240, v % n]`. With J padded to whole tiles, the padded axis was
    read at `v % n`, not at a plain iterator, so the reshape stayed out of the tile's store and
    the whole padded product went through a workspace (the GPT's logits: 16 MiB above eager's
    inference peak, and a pass over them). Simplified under the iterators' ranges, it reads
    `[b * 120 + t, v]` and fuses. Matches torch. 240 rows, which every tile's row count divides
    (with 256, Intel's 6-row tile padded I too, and a reshape reading a padded I through the
    modulo rightly stays out)."""
    m, n, k = 240, 100, 64
    a = te.placeholder((m, k), name="A")
    w = te.placeholder((n, k), name="W")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * w[j, r], axis=r), name="matmul")
    out = te.compute((2, 120, n), lambda b, t, v: c[(b * 120 + v // n + t) % m, v % n], name="reshape")
    func = te.create_prim_func([a, w, out])
    with TARGET:
        scheduled = ApplyCPUSchedules()(tvm.IRModule({"main": func}))["main"]
    script = scheduled.script()
    assert "T.unroll(" in script, "not register-tiled: the case is not exercised"
    assert 'T.sblock("reshape")' not in script, script
    x, y = torch.randn(m, k), torch.randn(n, k)
    got, _ = run_prim_func(func, x, y, out_shape=(2, 120, n))
    torch.testing.assert_close(got, (x @ y.T).reshape(2, 120, n), **TOL)


@pytest.mark.parametrize("b_trans", [False, True])
def test_matmul_packs_b_along_its_own_rows(b_trans: bool) -> None:
    """A panel of B is copied in the order B's rows run. W[k, n] (dy @ W in an input gradient):
    each step of K copies one contiguous 48-wide piece of a row, all three vectors of it (a
    vector at a time over all of K turned a new page per step: 64 x 4096 x 4096 13.4 -> 10.5 ms
    on Sapphire Rapids). W[n, k] (x @ W.T): 8 rows at a time (half a 16-lane vector), each row
    read along K: rows 4 KiB apart share an L1 set, which holds 8 on Zen 4 (64 x 1024 x 1024:
    0.92 -> 0.74 ms there)."""
    m, n, k = 64, 768, 1024
    func = te_matmul(m, n, k, False, b_trans)
    with tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"}):
        scheduled = ApplyCPUSchedules()(tvm.IRModule({"main": func}))["main"]
    sch = tvm.s_tir.Schedule(scheduled)
    loops = sch.get_loops(sch.get_sblock("B_global"))
    extents = [int(sch.get(loop).extent) for loop in loops]
    assert extents[-4:] == [3, 2, k, 8] if b_trans else extents[-3:] == [k, 3, 16], scheduled.script()[:2500]
    a, b, bias = torch.randn(m, k), torch.randn(*((n, k) if b_trans else (k, n))), torch.randn(n)
    out, _ = run_prim_func(func, a, b, bias, out_shape=(m, n))
    torch.testing.assert_close(out, torch.relu(a @ (b.T if b_trans else b) + bias), **TOL)


@pytest.mark.parametrize("a_trans, per_tile", [(False, True), (True, False)])
def test_matmul_pads_a_per_tile_when_its_rows_run_along_k(a_trans: bool, per_tile: bool) -> None:
    """131 rows, which no fast tile divides: A is zero-padded to whole tiles (a 6-row tile: 132
    rows; with 16 registers 128 rows are a 4-row tile's and 130 a 5-row tile's, unpadded). Rows
    of A along K (attention's Q, a layer's input) are copied tile by tile inside the parallel
    loop, a buffer of 6 x K; all of A padded up front stayed in TVM's workspace pool (2 MiB per
    attention product). A transposed A (dy in a weight gradient) keeps the one copy: per tile it
    would be gathered."""
    batch, m, n, k = 4, 131, 128, 64
    func = te_matmul(m, n, k, a_trans, False, batch)
    a = torch.randn(batch, k, m) if a_trans else torch.randn(batch, m, k)
    b, bias = torch.randn(batch, k, n), torch.randn(n)
    out, scheduled = run_prim_func(func, a, b, bias, out_shape=(batch, m, n))
    want = torch.relu((a.transpose(1, 2) if a_trans else a) @ b + bias)
    torch.testing.assert_close(out, want, **TOL)
    text = scheduled.script()
    pad = text.index('T.sblock("A_reindex_pad"')
    assert (text.index("T.parallel(") < pad) is per_tile, text[:4000]


@I.ir_module
class LinearLayer:
    @R.function
    def main(x: R.Tensor((64, 96), "float32"), w: R.Tensor((80, 96), "float32"),
             b: R.Tensor((80,), "float32")) -> R.Tensor((64, 80), "float32"):
        with R.dataflow():
            y = R.nn.relu(R.add(R.matmul(x, R.permute_dims(w)), b))
            R.output(y)
        return y


def test_linear_layer_through_the_pipeline() -> None:
    """nn.Linear + ReLU as the frontend emits it: every fused kernel gets scheduled."""
    x, w, b = torch.randn(64, 96), torch.randn(80, 96), torch.randn(80)
    out, scheduled = run_relax(LinearLayer, x, w, b)
    torch.testing.assert_close(out, torch.relu(x @ w.T + b), **TOL)
    for func in prim_funcs(scheduled).values():
        assert bool(func.attrs["tirx.is_scheduled"])


def test_linear_layer_with_fused_transpose() -> None:
    """After FuseTransposeMatmul the kernel reads W[N, K] directly and packs it."""
    x, w, b = torch.randn(64, 96), torch.randn(80, 96), torch.randn(80)
    mod = fuse(LinearLayer, relax.transform.FuseTransposeMatmul())
    assert Matmul().apply(unscheduled(mod, "matmul"), TARGET, False) is not None
    out, _ = run_relax(LinearLayer, x, w, b, extra=(relax.transform.FuseTransposeMatmul(),))
    torch.testing.assert_close(out, torch.relu(x @ w.T + b), **TOL)


# ---- gemv.py ----------------------------------------------------------------------------------

GEMVS = {
    # id: (m, n, k, batch); B is W[n, k], as in nn.Linear
    "batch1-linear": (1, 96, 80, 0),
    "batch3-linear-3x4-tile": (3, 40, 64, 0),
    "k-not-a-multiple-of-16": (1, 24, 36, 0),
    "batched-rows": (1, 16, 32, 3),
}


@pytest.mark.parametrize("case", GEMVS.values(), ids=GEMVS.keys())
def test_matrix_vector_rule_matches_torch(case: tuple) -> None:
    """x @ W.T + bias, ReLU with few rows of x: dot products along K, W read in place."""
    m, n, k, batch = case
    lead = (batch,) if batch else ()
    a, b, bias = torch.randn(*lead, m, k), torch.randn(*lead, n, k), torch.randn(n)
    func = te_matmul(m, n, k, False, True, batch)
    assert MatrixVector().apply(func, TARGET, False) is not None
    out, scheduled = run_prim_func(func, a, b, bias, out_shape=(*lead, m, n))
    torch.testing.assert_close(out, torch.relu(a @ b.transpose(-1, -2) + bias), **TOL)
    assert_scheduled(scheduled, parallel=False)
    assert "_rf" in scheduled.script(), "no partial sums per vector lane"


@pytest.mark.parametrize("case", [(1, 96, 80, False), (64, 80, 96, True)], ids=["x-w", "many-rows"])
def test_matrix_vector_rule_leaves_other_products_to_matmul(case: tuple) -> None:
    """x @ W with W[k, n] (contiguous along N), or more rows than K / 16: not this rule's."""
    m, n, k, b_trans = case
    assert MatrixVector().apply(te_matmul(m, n, k, False, b_trans), TARGET, False) is None


@pytest.mark.parametrize("m, k, taken", [(32, 1024, True), (16, 2048, True), (64, 1024, False),
                                         (16, 4096, False), (256, 4096, False), (1, 131072, True)])
def test_matrix_vector_rule_needs_the_rows_of_x_to_fit_in_l2(m: int, k: int, taken: bool) -> None:
    """Each group of W rows reads all of x: an x of more than MAX_A_BYTES (128 KiB; the large
    MLP's layers have 4 MiB) goes to the matmul rule, which reads it from L2 once per panel
    instead of from L3 (2.8x faster there). Batch 1 reads x once whatever its size."""
    func = te_matmul(m, 256, k, False, True)
    assert (MatrixVector().apply(func, TARGET, False) is not None) == taken


@pytest.mark.parametrize("m, n, k", [(64, 10, 1024), (64, 100, 1024), (256, 10, 4096)])
def test_matrix_vector_rule_takes_a_classifier_head_whatever_the_size_of_x(m: int, n: int, k: int) -> None:
    """With at most 128 rows of W (a classifier head) x is read only n / rj times: dot products
    beat packing W for the matmul rule (64 x 1024 -> 10 on Zen 3: 22 against 47 us) even where
    x is over 128 KiB. Matches torch."""
    func = te_matmul(m, n, k, False, True)
    assert MatrixVector().apply(func, TARGET, False) is not None
    a, b, bias = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    out, _ = run_prim_func(func, a, b, bias, out_shape=(m, n))
    torch.testing.assert_close(out, torch.relu(a @ b.T + bias), **TOL)


# ---- conv.py ---------------------------------------------------------------------------------

CONVS = {
    # id: (cin, cout, kernel, stride, padding, groups, hw)
    "3x3-s1": (3, 16, 3, 1, 1, 1, 12),
    "3x3-s2": (8, 16, 3, 2, 1, 1, 12),
    "depthwise-s1": (16, 16, 3, 1, 1, 16, 16),
    "depthwise-s2": (16, 16, 3, 2, 1, 16, 16),
    "depthwise-4x4": (32, 32, 3, 1, 1, 32, 4),
    "pointwise-1x1": (24, 40, 1, 1, 0, 1, 8),
}


def conv_module(n: int, cin: int, cout: int, kernel: int, stride: int, padding: int,
                groups: int, hw: int) -> tvm.IRModule:
    """conv2d(NCHW) followed by ReLU6 (clip), built with the Relax block builder."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((n, cin, hw, hw), "float32"))
    w = relax.Var("w", R.Tensor((cout, cin // groups, kernel, kernel), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, strides=stride, padding=padding, groups=groups))
            y = bb.emit_output(relax.op.clip(y, 0.0, 6.0))
        bb.emit_func_output(y)
    return bb.get()


@pytest.mark.parametrize("case", CONVS.values(), ids=CONVS.keys())
def test_conv2d_rules_match_torch(case: tuple) -> None:
    """Direct conv (windows > 1x1) goes to Conv2d, 1x1 to Matmul; both match torch."""
    cin, cout, kernel, stride, padding, groups, hw = case
    x = torch.randn(2, cin, hw, hw)
    w = torch.randn(cout, cin // groups, kernel, kernel) * 0.3
    mod = conv_module(2, cin, cout, kernel, stride, padding, groups, hw)
    conv = unscheduled(fuse(mod), "conv2d")
    expected_rule = Conv2d() if kernel > 1 else Matmul()
    assert expected_rule.apply(conv, TARGET, False) is not None
    if kernel == 1:
        assert Conv2d().apply(conv, TARGET, False) is None
    out, scheduled = run_relax(mod, x, w)
    expected = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding, groups=groups)
    torch.testing.assert_close(out, expected.clamp(0, 6), **TOL)
    assert_scheduled(unscheduled(scheduled, "conv2d"), parallel=False)


@pytest.mark.parametrize("hw", [12, 16, 20])
def test_conv_tiles_three_rows_with_16_registers_the_last_tile_partial(hw: int) -> None:
    """With AVX2's 16 vector registers a tile is 4 channels x 3 rows (12 accumulators); rows
    that are not a multiple of 3 leave a predicated last tile, whose rows (and the fused
    ReLU6 on them) must stay exact. Run at -O1 and -O3: only the speed may differ."""
    avx2 = Target({"kind": "llvm", "mcpu": "haswell"})
    x = torch.randn(2, 8, hw, hw)
    w = torch.randn(16, 8, 3, 3) * 0.3
    func = unscheduled(fuse(conv_module(2, 8, 16, 3, 1, 1, 1, hw)), "conv2d")
    scheduled = Conv2d().apply(func, avx2, False).mod["main"]
    text = scheduled.script()
    assert re.search(r"for \w+ in T\.unroll\(T\.int64\(3\)\)", text), text
    assert ("T.where(" in text) == (hw % 3 != 0)
    expected = torch.nn.functional.conv2d(x, w, padding=1).clamp(0, 6).numpy()
    for level in (1, 3):
        target = Target({"kind": "llvm", "mcpu": "haswell", "opt-level": level})
        lib = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=target)
        out = tvm.runtime.tensor(np.zeros((2, 16, hw, hw), "float32"))
        lib["main"](tvm.runtime.tensor(x.numpy()), tvm.runtime.tensor(w.numpy()), out)
        np.testing.assert_allclose(out.numpy(), expected, **TOL)


CONV_GRADS = {
    # id: (cin, cout, stride, groups, hw) of the forward 3x3 (or 1x1) convolution
    "pointwise-1x1": (16, 24, 1, 1, 8, 1),
    "pointwise-1x1-s2": (16, 24, 2, 1, 8, 1),
    # dW as an implicit GEMM (conv_gemm.py): channels that fill 4 x 2-vector tiles
    "3x3-s1-gemm": (64, 64, 1, 1, 4, 3),
    "1x1-gemm-channel-rows": (32, 32, 1, 1, 8, 1),
    "3x3-s2-gemm": (32, 64, 2, 1, 8, 3),
    "3x3-s1": (8, 16, 1, 1, 8, 3),
    "3x3-s2": (8, 16, 2, 1, 16, 3),
    "depthwise-s1": (16, 16, 1, 16, 8, 3),
    "depthwise-s2": (16, 16, 2, 16, 16, 3),
}


@pytest.mark.parametrize("case", CONV_GRADS.values(), ids=CONV_GRADS.keys())
def test_conv2d_gradients_match_torch(case: tuple) -> None:
    """dW (a conv whose window is the image: ConvWeightGradient) and dX (conv2d_transpose)
    as tvmgraph's autodiff writes them match torch's backward."""
    from tvmgraph.gradients.conv import conv_data_grad, conv_weight_grad

    cin, cout, stride, groups, hw, k = case
    pad = k // 2
    out_hw = (hw + 2 * pad - k) // stride + 1
    x = torch.randn(4, cin, hw, hw, requires_grad=True)
    w = torch.randn(cout, cin // groups, k, k, requires_grad=True)
    dy = torch.randn(4, cout, out_hw, out_hw)
    torch.nn.functional.conv2d(x, w, stride=stride, padding=pad, groups=groups).backward(dy)

    bb = relax.BlockBuilder()
    xv = relax.Var("x", R.Tensor(tuple(x.shape), "float32"))
    wv = relax.Var("w", R.Tensor(tuple(w.shape), "float32"))
    dyv = relax.Var("dy", R.Tensor(tuple(dy.shape), "float32"))
    with bb.function("main", [xv, wv, dyv]):
        with bb.dataflow():
            window = ((stride, stride), (pad,) * 4, (1, 1), groups, None)
            dx = conv_data_grad(dyv, wv, x.shape, *window)
            dw = conv_weight_grad(xv, dyv, w.shape, *window)
            out = bb.emit_output(relax.Tuple([bb.emit(dx), bb.emit(dw)]))
        bb.emit_func_output(out)
    mod = bb.get()
    fused = fuse(mod)
    if k > 1:
        weight_grad = [f for n, f in prim_funcs(fused).items()
                       if n.startswith(("conv2d", "fused_conv2d")) and "transpose" not in n]
        assert any(ConvWeightGradient().apply(f, TARGET, False) is not None for f in weight_grad)
    with TARGET:
        scheduled = ApplyCPUSchedules()(fused)
    vm = relax.VirtualMachine(finish(scheduled), tvm.cpu())
    got_dx, got_dw = vm["main"](*[tvm.runtime.tensor(t.detach().numpy()) for t in (x, w, dy)])
    torch.testing.assert_close(torch.from_numpy(got_dx.numpy()), x.grad, **TOL)
    torch.testing.assert_close(torch.from_numpy(got_dw.numpy()), w.grad, atol=1e-3, rtol=1e-4)
    for func in prim_funcs(scheduled).values():
        assert bool(func.attrs["tirx.is_scheduled"])


def _weight_grad_func(batch: int | tirx.Var, cin: int, cout: int, hw: int) -> tirx.PrimFunc:
    """The one PrimFunc of dW for a 3x3, stride 1, padding 1 conv, as autodiff writes it."""
    from tvmgraph.gradients.conv import conv_weight_grad

    bb = relax.BlockBuilder()
    xv = relax.Var("x", R.Tensor((batch, cin, hw, hw), "float32"))
    dyv = relax.Var("dy", R.Tensor((batch, cout, hw, hw), "float32"))
    with bb.function("main", [xv, dyv]):
        with bb.dataflow():
            dw = bb.emit(conv_weight_grad(xv, dyv, (cout, cin, 3, 3), (1, 1), (1,) * 4, (1, 1), 1, None))
            out = bb.emit_output(dw)
        bb.emit_func_output(out)
    (func,) = prim_funcs(fuse(bb.get())).values()
    return func.with_attr("global_symbol", "main")


@pytest.mark.parametrize("cin,cout", [(64, 64), (8, 32), (6, 48), (64, 24), (16, 12)])
def test_weight_gradient_runs_as_implicit_gemm_when_channels_fill_tiles(cin: int, cout: int) -> None:
    """F a multiple of 2, 3 or 4 vectors (of this host's lanes: 24 channels are 3 AVX2 vectors
    but 1.5 AVX-512 ones): dW reads dy channel-last (dy[n, y, x, f]) and keeps the kernel's 3
    columns x 2-4 vectors of accumulators; otherwise the row-vectorized form. Both match torch."""
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    gemm = any(cout % (vectors * lanes) == 0 for vectors in (2, 3, 4))
    x, dy = torch.randn(4, cin, 4, 4), torch.randn(4, cout, 4, 4)
    func = _weight_grad_func(4, cin, cout, 4)
    sch = ConvWeightGradient().apply(func, TARGET, False)
    assert sch is not None
    text = sch.mod["main"].script()
    assert (f"T.sblock_alloc_buffer((T.int64(4), T.int64(4), T.int64(4), T.int64({cout}))" in text) == gemm
    got, _ = run_prim_func(func, x, dy, out_shape=(cout, cin, 3, 3))
    want = torch.nn.grad.conv2d_weight(x, (cout, cin, 3, 3), dy, padding=1)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("cin, mcpu, rows, vectors", [
    (16, "sapphirerapids", (2, 3), 4), (3, "sapphirerapids", (3,), 4),
    (16, "haswell", (2, 3), 2), (16, "znver3", (2, 3), 2), (3, "znver3", (3,), 2)])
def test_weight_gradient_tile_fills_the_register_file(cin: int, mcpu: str, rows: tuple, vectors: int) -> None:
    """With AVX-512's 32 registers the implicit GEMM's tile is 2 input channels x the kernel's 3
    columns x 4 vectors (24 accumulators): each vector of dy loaded from L2 serves 6
    multiply-adds, not 3 (ResNet-18's dW on 16x16 images 50 -> 58% of the FMA peak); an odd
    channel count keeps 3 x 4 vectors. With AVX2's 16, 3 x 4 vectors (12 accumulators and 4
    vectors of dy) spilled: 2 channels x 3 x 2 vectors instead (ResNet-18's dW 1.6x faster on
    Zen 3). Matches torch."""
    x, dy = torch.randn(4, cin, 8, 8), torch.randn(4, 64, 8, 8)
    func = _weight_grad_func(4, cin, 64, 8)
    sch = ConvWeightGradient().apply(func, Target({"kind": "llvm", "mcpu": mcpu}), False)
    assert sch is not None
    update = next(b for b in sch.get_child_blocks(sch.get_sblock("root"))
                  if sch.get(b).name_hint.endswith("_update"))
    unrolled = [int(sch.get(loop).extent) for loop in sch.get_loops(update)
                if sch.get(loop).kind == tirx.ForKind.UNROLLED]
    assert unrolled == [*rows, vectors], unrolled  # rows, then vectors of output channels
    got, _ = run_prim_func(func, x, dy, out_shape=(64, cin, 3, 3))
    want = torch.nn.grad.conv2d_weight(x, (64, cin, 3, 3), dy, padding=1)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def test_weight_gradient_of_a_first_layer_runs_in_parallel() -> None:
    """An RGB input layer's dW (3 input channels, 16 output): its input channels make one tile,
    which the plane-per-tile (depthwise) loop ran on one core, 28 M multiply-adds; now the
    output tiles run in parallel. Matches torch."""
    x, dy = torch.randn(8, 3, 32, 32), torch.randn(8, 16, 32, 32)
    func = _weight_grad_func(8, 3, 16, 32)
    sch = ConvWeightGradient().apply(func, TARGET, False)
    assert sch is not None
    parallel = [line.strip() for line in sch.mod["main"].script().splitlines() if "T.parallel(" in line]
    assert parallel and all("range(T.int64(1))" not in line for line in parallel), parallel
    got, _ = run_prim_func(func, x, dy, out_shape=(16, 3, 3, 3))
    want = torch.nn.grad.conv2d_weight(x, (16, 3, 3, 3), dy, padding=1)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("batch, blocks", [(2, None), (6, 3)])
def test_weight_gradient_reads_dy_from_l2_in_blocks_of_images(batch: int, blocks: int | None) -> None:
    """64 channels on 32x32 images: 256 KiB of dy per image. Up to BLOCK_BYTES (512 KiB: 2
    images) each tile sums over all of K with its accumulators stored from registers; beyond,
    the images run in blocks of 2 outside the parallel loop over tiles, so that every tile of a
    block reads dy from L2 (ResNet-18's 32x32 dW: 4.4 -> 2.7 ms). Both match torch."""
    x, dy = torch.randn(batch, 64, 32, 32), torch.randn(batch, 64, 32, 32)
    func = _weight_grad_func(batch, 64, 64, 32)
    sch = ConvWeightGradient().apply(func, TARGET, False)
    assert sch is not None
    loops = [line.strip() for line in sch.mod["main"].script().splitlines() if line.strip().startswith("for ")]
    serial_around_parallel = [outer for outer, inner in zip(loops, loops[1:])
                              if "T.parallel(" in inner and " in range(" in outer]
    assert serial_around_parallel == ([f"for rc_0 in range(T.int64({blocks})):"] if blocks else []), loops
    got, _ = run_prim_func(func, x, dy, out_shape=(64, 64, 3, 3))
    want = torch.nn.grad.conv2d_weight(x, (64, 64, 3, 3), dy, padding=1)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)


def test_weight_gradient_over_a_symbolic_batch_is_scheduled() -> None:
    """A dynamic batch makes dW's reduction over images symbolic: still the implicit GEMM."""
    func = _weight_grad_func(tirx.Var("n", "int64"), 32, 32, 4)
    sch = ConvWeightGradient().apply(func, TARGET, False)
    assert sch is not None
    assert "T.sblock_alloc_buffer((n, T.int64(4), T.int64(4), T.int64(32)))" in sch.mod["main"].script()


# ---- reduction.py ----------------------------------------------------------------------------


def test_batch_statistics_over_a_symbolic_batch_are_vectorized() -> None:
    """sum over (N, H, W) of an NCHW tensor with a symbolic N (a dynamic batch's batch-norm
    statistics): N stays a serial loop outside, H * W is the vector; matches torch."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, 8, 4, 4), name="x")
    rn, rh, rw = (te.reduce_axis((0, e), name=name) for e, name in ((n, "rn"), (4, "rh"), (4, "rw")))
    total = te.compute((8,), lambda c: te.sum(x[rn, c, rh, rw], axis=[rn, rh, rw]), name="total")
    func = te.create_prim_func([x, total]).with_attr("global_symbol", "main")
    sch = Reduction().apply(func, TARGET, False)
    assert sch is not None and "T.vectorized" in sch.mod["main"].script()
    data = torch.randn(3, 8, 4, 4)
    got, _ = run_prim_func(func, data, out_shape=(8,))
    torch.testing.assert_close(got, data.sum((0, 2, 3)), **TOL)


def test_batch_statistics_over_a_symbolic_batch_run_on_every_core() -> None:
    """The same sum over (N, 96, 32, 32): its work is weighed at N = 64 (loops.work_extent), so
    the channels run in parallel (with N counted as 1 they ran on one core)."""
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, 96, 32, 32), name="x")
    rn, rh, rw = (te.reduce_axis((0, e), name=name) for e, name in ((n, "rn"), (32, "rh"), (32, "rw")))
    total = te.compute((96,), lambda c: te.sum(x[rn, c, rh, rw], axis=[rn, rh, rw]), name="total")
    sch = Reduction().apply(te.create_prim_func([x, total]).with_attr("global_symbol", "main"), TARGET, False)
    assert sch is not None and "for c in T.parallel(96):" in sch.mod["main"].script()


def test_matmul_epilogue_after_the_product_runs_in_parallel() -> None:
    """A Linear's pre-activation kept for the backward pass (a second output) and its GELU read
    back through a reshape (`(8*128 rows) x 1024` as `8 x 128 x 1024`): the activation cannot run
    per tile, so it runs after the whole product, over both cores (it ran on one: the
    transformer's GELU product took 5.3 ms per training step, 4.9 ms on both). Matches torch."""
    x = te.placeholder((1024, 64), name="x")
    w = te.placeholder((256, 64), name="w")
    k = te.reduce_axis((0, 64), name="k")
    pre = te.compute((1024, 256), lambda i, j: te.sum(x[i, k] * w[j, k], axis=k), name="pre")
    act = te.compute((8, 128, 256), lambda a, b, c: te.max(pre[(a * 128 + b + c // 256) % 1024, c % 256], 0.0),
                     name="act")
    sch = Matmul().apply(te.create_prim_func([x, w, pre, act]).with_attr("global_symbol", "main"), TARGET, False)
    assert sch is not None
    loops = sch.get_loops(sch.get_sblock("act"))
    assert any(sch.get(loop).kind == tirx.ForKind.PARALLEL for loop in loops), sch.mod["main"].script()
    xs, ws = torch.randn(1024, 64), torch.randn(256, 64)
    lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=TARGET)
    out = [tvm.runtime.tensor(np.zeros(shape, "float32")) for shape in ((1024, 256), (8, 128, 256))]
    lib["main"](tvm.runtime.tensor(xs.numpy()), tvm.runtime.tensor(ws.numpy()), *out)
    torch.testing.assert_close(torch.from_numpy(out[1].numpy()), torch.relu(xs @ ws.T).reshape(8, 128, 256), **TOL)


@pytest.mark.parametrize("rows, k_extent, copied", [(512, 256, True), (512, 64, False), (96, 256, False)])
def test_transposed_a_is_copied_with_rows_along_k_for_long_sums(rows: int, k_extent: int, copied: bool) -> None:
    """A weight gradient x.T @ dy reads A = x.T, whose rows run across K: read in place, each
    step of K is a new cache line and page (2.2x the time of the copied product on Sapphire
    Rapids). From TRANSPOSED_A_COPY_K steps, and when A outgrows the caches
    (TRANSPOSED_A_COPY_MIN_BYTES), A is copied once with its rows along K; a short sum (K = 64)
    or a small A (96 x 256, like an attention gradient's 128 x 128 P per head: 0.54 ms in place
    against 0.62 copied) is read in place. Matches torch either way."""
    x = te.placeholder((k_extent, rows), name="x")
    dy = te.placeholder((k_extent, 64), name="dy")
    k = te.reduce_axis((0, k_extent), name="k")
    dw = te.compute((rows, 64), lambda i, j: te.sum(x[k, i] * dy[k, j], axis=k), name="dw")
    sch = Matmul().apply(te.create_prim_func([x, dy, dw]).with_attr("global_symbol", "main"), TARGET, False)
    assert sch is not None
    script = sch.mod["main"].script()
    # Copied: A's rows along K. A tile that pads the rows (some CPUs' tables pick one) copies A
    # the same way in any case.
    copy = re.search(rf"x_reindex(_pad)? = T.sblock_alloc_buffer\(\(1, (\d+), {k_extent}\)\)", script)
    padded = copy is not None and copy.group(1) is not None
    assert (copy is not None) == (copied or padded), script
    xs, dys = torch.randn(k_extent, rows), torch.randn(k_extent, 64)
    got, _ = run_prim_func(sch.mod["main"], xs, dys, out_shape=(rows, 64))
    torch.testing.assert_close(got, xs.T @ dys, **TOL)


def test_rows_with_little_output_but_long_sums_run_in_parallel() -> None:
    """A batch norm's running-mean update: one value per channel, each the sum of 64 x 16 x 16
    elements. Its rows' work is the sums', not the single output's: 144 channels ran on one
    core when only the output block was counted. Matches torch."""
    x = te.placeholder((64, 144, 16, 16), name="x")
    running = te.placeholder((144,), name="running")
    n, h, w = te.reduce_axis((0, 64), "n"), te.reduce_axis((0, 16), "h"), te.reduce_axis((0, 16), "w")
    total = te.compute((144,), lambda c: te.sum(x[n, c, h, w], axis=[n, h, w]), name="total")
    out = te.compute((144,), lambda c: running[c] * 0.9 + total[c] * (0.1 / 16384), name="out")
    func = te.create_prim_func([x, running, out]).with_attr("global_symbol", "main")
    sch = Reduction().apply(func, TARGET, False)
    assert sch is not None and "for c in T.parallel(144):" in sch.mod["main"].script()
    xs, rs = torch.randn(64, 144, 16, 16), torch.randn(144)
    got, _ = run_prim_func(func, xs, rs, out_shape=(144,))
    torch.testing.assert_close(got, rs * 0.9 + xs.mean(dim=(0, 2, 3)) * 0.1, **TOL)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_matmul_over_a_symbolic_axis_the_tile_divides_reads_b_in_place(batch: int) -> None:
    """C[i, m, j] = A[i, k] B[k, m, j], J = (m, j) of n * 3072 (a 1x1 convolution over a dynamic batch): every
    tile width divides J whatever n is, so B is read in place, unpadded and unpacked, as in the
    static product (a padded copy of B was made before). 12 rows of A: fewer than reread a panel
    enough to pack it on any CPU (CPUTarget.pack_reused_rows). Matches numpy at every n."""
    n = tirx.Var("n", "int64")
    i64 = lambda v: tirx.IntImm("int64", v)  # noqa: E731  (one index type with n's)
    a = te.placeholder((i64(12), i64(32)), name="a")
    b = te.placeholder((i64(32), n, i64(3072)), name="b")
    k = te.reduce_axis((i64(0), i64(32)), name="k")
    c = te.compute((i64(12), n, i64(3072)), lambda i, m, j: te.sum(a[i, k] * b[k, m, j], axis=k), name="c")
    func = te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")
    sch = Matmul().apply(func, TARGET, False)
    assert sch is not None and "b_global" not in sch.mod["main"].script()  # no copy of B
    x, y = torch.randn(12, 32), torch.randn(32, batch, 3072)
    got, _ = run_prim_func(func, x, y, out_shape=(12, batch, 3072))
    torch.testing.assert_close(got, torch.einsum("ik,kmj->imj", x, y), **TOL)


def test_tile_of_a_symbolic_axis_divides_what_the_axis_is_a_multiple_of() -> None:
    """The transformer's 8192 x 1024 x 256 product: with 8192 rows the 6-row tile wins (two rows
    of padding); with n * 128 rows (a dynamic batch at 64) padding is a run-time copy of A, and
    the tile's rows divide 128 instead."""
    static = choose_tile(8192, 256, 16, 32, 1024, 4, False, core="zen")
    dynamic = choose_tile(8192, 256, 16, 32, 1024, 4, False, i_multiple=128, core="zen")
    assert static.mi == 6
    assert 128 % dynamic.mi == 0
    # A GPT's tied-embedding gradient, 4096 x 256 summed over n * 128 tokens: padding the static
    # I would copy A along the symbolic K, one scalar at a time.
    assert choose_tile(4096, 256, 16, 32, 8192, 4, False, core="zen").mi == 6
    assert 4096 % choose_tile(4096, 256, 16, 32, 8192, 4, False, symbolic_k=True, core="zen").mi == 0


def test_tiles_follow_the_core_family() -> None:
    """Each core family's own measurements (matmul.TILES): on Sapphire Rapids 8 x 3 ran fastest
    from K = 256 and 4 x 3 at K = 64, where the 1.5 KiB accumulator's per-tile allocation
    costs; Zen 5 keeps 4 x 3 at K = 256. A target's LLVM name picks the family."""
    intel = [choose_tile(m, n, 16, 32, k, 4, False, core="intel") for m, k, n in
             ((1024, 256, 1024), (64, 1024, 1024), (256, 4096, 4096), (1024, 64, 1024))]
    assert [(t.mi, t.nvec) for t in intel] == [(8, 3), (8, 3), (8, 3), (4, 3)]
    zen = choose_tile(1024, 1024, 16, 32, 256, 4, False, core="zen")
    assert (zen.mi, zen.nvec) == (4, 3)
    assert CPUTarget.from_target(Target({"kind": "llvm", "mcpu": "znver5"})).core == "zen"
    assert CPUTarget.from_target(Target({"kind": "llvm", "mcpu": "znver4"})).core == "zen4"
    assert CPUTarget.from_target(Target({"kind": "llvm", "mcpu": "sapphirerapids"})).core == "intel"


@pytest.mark.parametrize("i, j, k, b_contiguous", [
    (512, 256, 4608, True),    # ResNet-18's layer-4 im2col product, 16 images of 4x4 pixels
    (256, 1024, 2304, True),   # its layer-3 product, 16 images of 8x8 pixels
    (64, 1024, 1024, False),   # the batch-64 MLP's x @ W.T
    (8192, 256, 1024, False),  # the transformer's 8192-token product
])
def test_on_zen4_a_tile_that_divides_the_product_beats_padding_it(i: int, j: int, k: int,
                                                                   b_contiguous: bool) -> None:
    """On Zen 4 every tile of at most 8 rows runs within 3% of the others, and padding I costs
    8-20% (each tile's rows of A copied once per panel): ResNet-18's layer-4 product ran at 80%
    of the FMA peak with 6 x 4 (512 rows padded to 516), 92-94% with 4 x 4 or 8 x 2. Zen 5's
    table keeps its 6 x 4 where padding I costs it 5%."""
    tile = choose_tile(i, j, 16, 32, k, 4, b_contiguous, core="zen4")
    assert i % tile.mi == 0 and j % tile.nj == 0, tile
    assert tile.mi <= 8  # 12 or 16 rows of A 4 KiB apart share one set of the 8-way L1d
    if i == 512:
        assert choose_tile(i, j, 16, 32, k, 4, b_contiguous, core="zen").mi == 6
    # Where no tile divides (a ViT's 65 tokens), the fastest that pads least.
    tile = choose_tile(65, 65, 16, 32, 32, 4, False, core="zen4")
    assert (tile.mi, tile.nvec) == (5, 3)


def test_with_16_registers_a_tile_that_divides_i_beats_padding_it() -> None:
    """AVX2 (8 lanes, 16 registers): padding I copies each tile's rows of A once per 16-24-column
    panel, 17-45% of the product on Zen 3, more than padding J = 64 to 72; over 1024 or 64 rows a
    4-row tile is taken, over 1020 (no padding of I) the 6 x 2 tile, the fastest there."""
    for rows in (1024, 64):
        assert rows % choose_tile(rows, 64, 8, 16, 256, 4, False, core="zen").mi == 0
    tile = choose_tile(1020, 64, 8, 16, 256, 4, False, core="zen")
    assert (tile.mi, tile.nvec) == (6, 2)
    # A ViT's 65 tokens (64 patches and a class token): 5 rows, in QK^T and in P @ V.
    for j, k, b_contiguous in ((65, 32, False), (32, 65, True)):
        tile = choose_tile(65, j, 8, 16, k, 4, b_contiguous, core="zen")
        assert (tile.mi, tile.nvec) == (5, 2), (j, k, tile)


@pytest.mark.parametrize("mcpu", ["znver3", "sapphirerapids"])
@pytest.mark.parametrize("n, k, streamed", [
    (1024, 256, True), (2048, 64, True), (784, 256, None), (1024, 20, False), (1024, 100, False),
])
def test_one_row_of_a_reads_b_in_place_a_few_rows_at_a_time(mcpu: str, n: int, k: int, streamed) -> None:
    """relu(x @ W + b) at batch 1 with W[k, n] read in place: each panel of W read down all of K
    visited one page per row (1 x 4096 x 4096 3.5 ms on Zen 3, 55-62% of the copy bandwidth);
    in steps of matmul.ROW_STEP rows over all of a thread's panels it reads rows along their
    length (2.2-2.4 ms). Not where K is short or not a multiple of the step, nor (None: it depends
    on the panel width and the threads) where the panels do not split evenly. Matches torch."""
    func = te_matmul(1, n, k, False, False)
    with tvm.target.Target({"kind": "llvm", "mcpu": mcpu}):
        scheduled = ApplyCPUSchedules()(tvm.IRModule({"main": func}))["main"]
    text = scheduled.script()
    assert 'T.sblock("B_' not in text  # W read in place
    steps = re.search(rf"T.axis.reduce\({k}, \w+ \* {ROW_STEP} \+ \w+\)", text) is not None
    if streamed is not None and os.cpu_count() > 1:
        assert steps is streamed, text[:3000]
    a, b, bias = torch.randn(1, k), torch.randn(k, n), torch.randn(n)
    out, _ = run_prim_func(func, a, b, bias, out_shape=(1, n))
    torch.testing.assert_close(out, torch.relu(a @ b + bias), **TOL)


@pytest.mark.parametrize("target, bits, registers", [
    ({"mcpu": "sapphirerapids"}, 512, 32), ({"mcpu": "znver4"}, 512, 32), ({"mcpu": "haswell"}, 256, 16),
    ({"mcpu": "znver3"}, 256, 16), ({}, 128, 16), ({"mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a72"}, 128, 16),
])
def test_vector_width_is_the_targets_not_the_hosts(target: dict, bits: int, registers: int) -> None:
    """LLVM's vector-width query answers with the host's width on x86 (512 for `haswell` on an
    AVX-512 machine): a program exported for an AVX2 CPU got 16-lane tiles and 32 registers'
    worth of accumulators. The width comes from the target CPU's own features."""
    cpu = CPUTarget.from_target(Target({"kind": "llvm", **target}))
    assert (cpu.vector_bits, cpu.num_vector_registers) == (bits, registers)


def unary_module(shape: tuple[int, ...], op) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(op(x))
        bb.emit_func_output(y)
    return bb.get()


REDUCTIONS = {
    "softmax-rows": ((8, 4, 32, 64), lambda x: relax.op.nn.softmax(x, axis=-1),
                     lambda x: torch.softmax(x, -1)),
    "sum-over-batch-bias-grad": ((64, 96), lambda x: relax.op.sum(x, axis=[0]),
                                 lambda x: x.sum(0)),
    "mean-over-NHW-batchnorm-stats": ((16, 24, 8, 8), lambda x: relax.op.mean(x, axis=[0, 2, 3]),
                                      lambda x: x.mean((0, 2, 3))),
    "variance-over-NHW": ((16, 24, 8, 8), lambda x: relax.op.variance(x, axis=[0, 2, 3]),
                          lambda x: x.var((0, 2, 3), unbiased=False)),
    "max-last-axis": ((96, 80), lambda x: relax.op.max(x, axis=[-1]),
                      lambda x: x.amax(-1)),
    "global-avg-pool": ((32, 48, 4, 4), lambda x: relax.op.mean(x, axis=[2, 3]),
                        lambda x: x.mean((2, 3))),
}


@pytest.mark.parametrize("case", REDUCTIONS.values(), ids=REDUCTIONS.keys())
def test_reduction_rule_matches_torch(case: tuple) -> None:
    """Row and column reductions are vectorized, and exact to float32 summation order."""
    shape, relax_op, torch_op = case
    x = torch.randn(*shape)
    mod = unary_module(shape, relax_op)
    assert Reduction().apply(next(iter(prim_funcs(fuse(mod)).values())), TARGET, False) is not None
    out, scheduled = run_relax(mod, x)
    torch.testing.assert_close(out, torch_op(x), **TOL)
    for func in prim_funcs(scheduled).values():
        assert_scheduled(func, parallel=False)


def test_a_reduction_over_several_axes_cuts_its_vector_from_the_innermost() -> None:
    """A sum over both axes of (64, 1024): the vector loads read x[k0, 16 * k1 + lane], not the
    div/mod of one fused index, which LLVM at -O1 leaves as 16 scalar loads."""
    x = torch.randn(64, 1024)
    mod = unary_module((64, 1024), lambda v: relax.op.sum(v))
    out, scheduled = run_relax(mod, x)
    torch.testing.assert_close(out, x.sum(), atol=1e-2, rtol=1e-4)
    (func,) = prim_funcs(scheduled).values()
    text = func.script()
    assert "T.vectorized" in text and "//" not in text and "%" not in text


@pytest.mark.parametrize("shape,op", [((8, 128, 256), "mean"), ((262144,), "sum"), ((64, 3, 32, 32), "sum"),
                                      ((1, 3, 256, 256), "sum")],
                         ids=["mean-of-an-activation", "sum-1d", "sum-nchw", "sum-batch-of-one"])
def test_a_reduction_to_one_value_is_summed_in_chunks(shape: tuple, op: str) -> None:
    """A sum or mean of a whole tensor (an MSE loss) is one rule's schedule (`mean`'s final
    divide, a block without a loop, made rfactor fail, and one serial chain ran instead),
    summed in chunks: within 3e-7 of the float64 sum (one chain of float32 additions: 5e-5 for
    the mean, 6e-7 and 9e-7 for the sums; torch's own: 6e-8 to 1.5e-7). A batch of one's loop
    of extent 1 made the chunked schedule fail half-way, and one serial chain ran."""
    torch.manual_seed(0)
    x = torch.rand(*shape) + (torch.randn(*shape) if op == "mean" else 0)
    x = x * x if op == "mean" else x  # an MSE's squares
    mod = unary_module(shape, lambda v: getattr(relax.op, op)(v))
    assert Reduction().apply(next(iter(prim_funcs(fuse(mod)).values())), TARGET, False) is not None
    out, scheduled = run_relax(mod, x)
    exact = getattr(x.double(), op)().item()
    assert abs(out.item() - exact) <= 3e-7 * abs(exact), (out.item(), exact)
    for func in prim_funcs(scheduled).values():  # parallel from MIN_PARALLEL_ELEMENTS on
        assert_scheduled(func, parallel=x.numel() >= MIN_PARALLEL_ELEMENTS)


@I.ir_module
class LayerNorm:
    @R.function
    def main(x: R.Tensor((8, 128, 256), "float32"), g: R.Tensor((256,), "float32"),
             b: R.Tensor((256,), "float32")) -> R.Tensor((8, 128, 256), "float32"):
        with R.dataflow():
            y = R.nn.layer_norm(x, g, b, axes=[-1], epsilon=1e-5)
            R.output(y)
        return y


def test_layer_norm_rows_are_parallel_and_vectorized() -> None:
    """layer_norm: two reductions and the normalization fused per row, rows in parallel."""
    x, g, b = torch.randn(8, 128, 256), torch.randn(256), torch.randn(256)
    out, scheduled = run_relax(LayerNorm, x, g, b)
    expected = torch.nn.functional.layer_norm(x, (256,), g, b, eps=1e-5)
    torch.testing.assert_close(out, expected, **TOL)
    assert_scheduled(unscheduled(scheduled, "layer_norm"))


def _channel_module(shape: tuple[int, ...], body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", R.Tensor(shape, "float32")), relax.Var("y", R.Tensor(shape, "float32"))
    params = [relax.Var(name, R.Tensor((shape[1],), "float32")) for name in ("g", "b", "m", "v")]
    with bb.function("main", [x, y, *params]):
        with bb.dataflow():
            out = bb.emit_output(body(x, y, *params))
        bb.emit_func_output(out)
    return bb.get()


def test_batch_norm_statistics_and_normalization_run_channel_by_channel() -> None:
    """Training batch-norm's mean, variance and normalization all read x: one parallel loop
    over the channels runs the three for one channel in turn, so that the channel comes from
    memory once and from cache twice, where block by block each read all of x (the CNN's
    batch-norm kernels 11-26% faster on Zen 3). Outputs and running statistics against torch."""
    channels = CHANNELS_PER_THREAD * (os.cpu_count() or 1)
    shape = (32, channels, 32, 32)  # a channel: 128 KiB
    x, y = torch.randn(*shape) * 2 + 1, torch.randn(*shape)
    g, b, mean, var = torch.rand(channels) + 0.5, torch.randn(channels), torch.randn(channels), torch.rand(channels) + 1
    mod = _channel_module(shape, lambda x, y, g, b, m, v: relax.op.nn.batch_norm(x, g, b, m, v, axis=1, training=True))
    (out, new_mean, new_var), scheduled = run_relax(mod, x, y, g, b, mean, var)
    (func,) = prim_funcs(scheduled).values()
    running_mean, running_var = mean.clone(), var.clone()
    expected = torch.nn.functional.batch_norm(x, running_mean, running_var, g, b, training=True, momentum=0.1)
    torch.testing.assert_close(out, expected, **TOL)
    # Relax's running variance is the biased one (torch's is unbiased): compare the means only.
    torch.testing.assert_close(new_mean, running_mean, **TOL)
    assert new_var.shape == (channels,)
    assert func.script().count("T.parallel(") == 1, func.script()


def test_a_channel_statistic_of_one_tensor_applied_to_another_runs_block_by_block() -> None:
    """mean(x) * y reads nothing twice: per channel it only lost parallelism and vector
    indexing (25% slower), so each block keeps its own parallel loop."""
    channels = CHANNELS_PER_THREAD * (os.cpu_count() or 1)
    shape = (32, channels, 32, 32)  # a channel: 128 KiB
    x, y = torch.randn(*shape), torch.randn(*shape)
    mod = _channel_module(shape, lambda x, y, *_: relax.op.multiply(relax.op.mean(x, axis=[0, 2, 3], keepdims=True), y))
    out, scheduled = run_relax(mod, x, y, *torch.ones(4, channels))
    (func,) = prim_funcs(scheduled).values()
    torch.testing.assert_close(out, x.mean((0, 2, 3), keepdim=True) * y, **TOL)
    assert func.script().count("T.parallel(") == 2


@pytest.mark.parametrize("vectors, chains", [(8, ROW_CHAINS), (4, 2), (2, 1)])
def test_row_sums_run_in_several_chains_of_vectors(vectors: int, chains: int) -> None:
    """A row summed into one vector is one chain of dependent additions (32 in sequence for 256
    floats of AVX2): the partial sums run in up to ROW_CHAINS vectors, added into one at the
    end (layer_norm over 1024 x 256 on Zen 3: 0.22 -> 0.05 ms); a row too short for two
    vectors per chain keeps fewer. Softmax's max and sum both, numbers against torch."""
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    row = vectors * lanes
    x = torch.randn(64, row) * 3 + 1
    out, scheduled = run_relax(unary_module((64, row), lambda v: relax.op.nn.softmax(v, axis=-1)), x)
    torch.testing.assert_close(out, torch.softmax(x, -1), **TOL)
    (func,) = prim_funcs(scheduled).values()
    widths = {int(w) for w in re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", func.script())}
    assert max(widths) == chains * lanes, widths


@pytest.mark.parametrize("vectors, tail", [(8, 1), (3, 3), (2, 2)])
def test_rows_that_no_vector_divides_are_vectorized_but_for_a_tail(vectors: int, tail: int) -> None:
    """Softmax over rows of 65 (a ViT's 64 patches and class token): no vector divides 65, and
    its exp and division ran one float at a time (16 x 4 x 65 x 65 on Zen 3: 0.96 ms, 3x what
    the vectorized rows take). Those loops are cut into whole vectors and a serial tail:
    `range(whole, row)` after a vectorized loop. Numbers against torch."""
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    row = vectors * lanes + tail
    x = torch.randn(4, 2, row, row) * 3 + 1
    out, scheduled = run_relax(unary_module(tuple(x.shape), lambda v: relax.op.nn.softmax(v, axis=-1)), x)
    torch.testing.assert_close(out, torch.softmax(x, -1), **TOL)
    (func,) = prim_funcs(scheduled).values()
    text = func.script()
    whole = row - tail
    # The exp and the division: each a vectorized loop over `whole` floats, then the tail.
    assert text.count(f"in range(T.int64({whole}), T.int64({row})):") == 2, text
    assert text.count(f"T.vectorized(T.int64({lanes}))") >= 2, text


def test_sums_over_small_images_take_in_the_rows_for_their_chains() -> None:
    """A batch-norm statistic over 8 x 8 images: the contiguous W = 8 is one vector, one chain
    of dependent additions; the vector takes in the H loop too (H and W are one contiguous run)
    for ROW_CHAINS chains (the CNN's variance kernels 0.45-0.54 of their time on Zen 3). The
    mean against torch."""
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    shape = (32, 16, 8, lanes)
    x = torch.randn(*shape) * 3 + 1
    out, scheduled = run_relax(unary_module(shape, lambda v: relax.op.mean(v, axis=[0, 2, 3])), x)
    torch.testing.assert_close(out, x.mean((0, 2, 3)), **TOL)
    (func,) = prim_funcs(scheduled).values()
    widths = {int(w) for w in re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", func.script())}
    assert max(widths) == ROW_CHAINS * lanes, widths


LONG_SUMS = {
    # (shape, the Relax op, torch's, the bound on the error relative to the float64 result's
    # largest value; what it was before, one chain per column or per lane)
    "column-sum": ((200003, 4), lambda v: relax.op.sum(v, axis=[0]), lambda x: x.sum(0), 2e-6),  # 1.3e-5
    "column-variance": ((200003, 4), lambda v: relax.op.variance(v, axis=[0]),
                        lambda x: x.var(0, unbiased=False), 5e-6),  # 6e-5
    "ragged-row-layer-norm": ((2, 100003), lambda v: relax.op.nn.layer_norm(
        v, relax.const(np.ones(100003, "float32")), relax.const(np.zeros(100003, "float32")), axes=[-1]),
        lambda x: torch.nn.functional.layer_norm(x, (100003,)), 1e-4),  # 5.6e-4
    "long-row-variance": ((4, 2, 524288), lambda v: relax.op.variance(v, axis=[0, 2]),
                          lambda x: x.var((0, 2), unbiased=False), 2e-6),  # 3e-6
}


@pytest.mark.slow
@pytest.mark.parametrize("case", LONG_SUMS.values(), ids=LONG_SUMS.keys())
def test_long_sums_of_data_far_from_zero_keep_their_digits(case: tuple) -> None:
    """Sums of 1e3 + randn, the kind of data where a long chain of float32 additions loses the
    digits that matter: a column reduction is cut into chunks of rows (`_column_chunks`), a row
    that no vector divides into whole vectors and a partial one (`_rfactor_row`: it had been one
    serial chain, and a layer norm over 500009 of them came out noise), and a row too long for
    its chains into chunks (`_chunk_long_row`). Each within its bound of float64."""
    shape, relax_op, torch_op, bound = case
    torch.manual_seed(0)
    x = torch.randn(*shape) + 1e3
    out, scheduled = run_relax(unary_module(shape, relax_op), x)
    exact = torch_op(x.double())
    error = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    assert error <= bound, error
    for func in prim_funcs(scheduled).values():
        assert_scheduled(func, parallel=False)


def test_a_row_whose_chunks_no_vector_divides_keeps_to_its_own_values() -> None:
    """A max over (540, 4099) per row: the row is cut into chunks of 3 x 4099 (no vector
    divides them, though 4 divides 540 x 4099), whose chains need a predicate; moved under the
    row, they dropped it, and row 0's max read row 1's values (101.99 for 4.93)."""
    x = torch.randn(2, 540, 4099)
    x[1] += 100
    out, _ = run_relax(unary_module((2, 540, 4099), lambda v: relax.op.max(v, axis=[1, 2])), x)
    torch.testing.assert_close(out, x.amax((1, 2)), atol=0, rtol=0)


def test_a_long_ragged_rows_chains_peel_their_partial_vector_and_normalize_row_by_row() -> None:
    """A layer norm over rows of 100003: the chains' last vector (under the predicate) is a
    loop of its own, and the normalization runs row by row, whole vectors then a tail (under
    the predicate LLVM ran the whole vector loop lane by lane, and fused across rows each lane
    gathered its row's mean: 1.41 -> 0.35 ms for (8, 100003) on Zen 3). Numbers against torch."""
    n = 100003
    x = torch.randn(8, n) * 3 + 1
    out, scheduled = run_relax(unary_module((8, n), lambda v: relax.op.nn.layer_norm(
        v, relax.const(np.ones(n, "float32")), relax.const(np.zeros(n, "float32")), axes=[-1])), x)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (n,)), **TOL)
    (func,) = prim_funcs(scheduled).values()
    text = func.script()
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    whole = n // (lanes * ROW_CHAINS)  # the chains' whole steps; the last one peeled
    assert text.count(f"in range(T.int64({whole}), T.int64({whole + 1})):") == 2, text  # the sum's, the variance's
    assert f"in range(T.int64({n - n % lanes}), T.int64({n})):" in text, text  # the normalization's tail


def test_an_argmax_reduction_runs_its_rows_in_parallel() -> None:
    """Max pooling's gradient (TOPI's, for overlapping windows) first takes each window's argmax:
    a reduction to two buffers (index and value), which rfactor cannot split; its nest was left
    serial (a raw-audio net's 1981-sample pooling gradient). Its rows run in parallel now, and
    dx is torch's."""
    dy_shape, x_shape = (16, 32, 1, 258), (16, 32, 1, 517)  # enough work to run in parallel
    bb = relax.BlockBuilder()
    dy, x = relax.Var("dy", R.Tensor(dy_shape, "float32")), relax.Var("x", R.Tensor(x_shape, "float32"))
    with bb.function("main", [dy, x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.grad.max_pool2d_backward(
                dy, x, (1, 3), (1, 2), (0, 0, 0, 0), (1, 1))))
        bb.emit_func_output(out)
    a = torch.randn(x_shape, requires_grad=True)
    g = torch.randn(dy_shape)
    torch.nn.functional.max_pool2d(a, (1, 3), (1, 2)).backward(g)
    got, scheduled = run_relax(bb.get(), g, a.detach())
    text = scheduled["max_pool2d_backward"].script()
    argmax = text[:text.index('T.sblock("maxpool_grad_argmax")')]
    assert "T.parallel(" in argmax, argmax
    torch.testing.assert_close(got, a.grad, atol=0, rtol=0)


def test_a_pooling_window_along_rows_no_vector_divides_runs_in_parallel_and_in_vectors() -> None:
    """MaxPool1d(4) over (16, 32, 1981), a (1, 4) max_pool2d after an expand_dims: a reduction
    of 4 along 495 output columns that no vector divides. Its work per output was counted as 1,
    below the parallel threshold, and the whole pooling ran on one thread (a raw-audio net's,
    1.07 ms; 0.52 ms in parallel, Zen 3); then one output at a time (0.76 ms on the Xeon, 0.17
    with the columns in whole vectors and a serial tail). Numbers: torch's, exactly."""
    shape = (16, 32, 1, 1981)
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.max_pool2d(x, (1, 4), (1, 4))))
        bb.emit_func_output(out)
    a = torch.randn(shape)
    got, scheduled = run_relax(bb.get(), a)
    text = scheduled["max_pool2d"].script()
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    whole = 495 - 495 % lanes
    assert "T.parallel(" in text, text
    assert f"T.vectorized(T.int64({lanes}))" in text and f"in range(T.int64({whole}), T.int64(495))" in text, text
    torch.testing.assert_close(got, torch.nn.functional.max_pool2d(a, (1, 4), (1, 4)), atol=0, rtol=0)


# ---- elementwise.py and fast_math.py ---------------------------------------------------------

ELEMENTWISE = {
    "gelu-erf": ((64, 512), lambda x: relax.op.nn.gelu(x),
                 lambda x: torch.nn.functional.gelu(x)),
    "transpose-2d": ((96, 80), lambda x: relax.op.permute_dims(x),
                     lambda x: x.T.contiguous()),
    "sigmoid-silu": ((32, 4096), lambda x: relax.op.multiply(x, relax.op.sigmoid(x)),
                     lambda x: torch.nn.functional.silu(x)),
    "tanh": ((64, 4096), lambda x: relax.op.tanh(x), torch.tanh),
    "relu6-nchw": ((4, 16, 8, 8), lambda x: relax.op.clip(x, 0.0, 6.0),
                   lambda x: x.clamp(0, 6)),
    # MHA's keys: (S, N, E) -> heads -> (N, H, D, S), through two reshapes and two transposes
    "attention-key-transpose": ((32, 2, 64), lambda x: relax.op.permute_dims(relax.op.reshape(
        relax.op.permute_dims(relax.op.reshape(x, (32, 8, 16)), [1, 0, 2]), (2, 4, 32, 16)), [0, 1, 3, 2]),
        lambda x: x.reshape(32, 8, 16).permute(1, 0, 2).reshape(2, 4, 32, 16).permute(0, 1, 3, 2).contiguous()),
    # A ViT's 65 tokens: the last column of transpose tiles is ragged.
    "attention-key-transpose-65-tokens": ((65, 2, 64), lambda x: relax.op.permute_dims(relax.op.reshape(
        relax.op.permute_dims(relax.op.reshape(x, (65, 8, 16)), [1, 0, 2]), (2, 4, 65, 16)), [0, 1, 3, 2]),
        lambda x: x.reshape(65, 8, 16).permute(1, 0, 2).reshape(2, 4, 65, 16).permute(0, 1, 3, 2).contiguous()),
}


@pytest.mark.parametrize("case", ELEMENTWISE.values(), ids=ELEMENTWISE.keys())
def test_elementwise_rule_matches_torch(case: tuple) -> None:
    """Injective kernels (with fast exp/erf/tanh) vectorize and stay within 1e-5 of torch."""
    shape, relax_op, torch_op = case
    x = torch.randn(*shape) * 3
    mod = unary_module(shape, relax_op)
    assert Elementwise().apply(next(iter(prim_funcs(fuse(mod)).values())), TARGET, False)
    out, scheduled = run_relax(mod, x)
    torch.testing.assert_close(out, torch_op(x), atol=1e-5, rtol=1e-5)
    for func in prim_funcs(scheduled).values():
        assert_scheduled(func, parallel=np.prod(shape) >= 1 << 18)
        assert "T.erf" not in func.script() and "T.tanh" not in func.script()


def test_a_per_channel_scale_along_rows_no_vector_divides_is_one_broadcast_per_row() -> None:
    """A batch norm + ReLU at inference over (16, 32, 1981): no vector divides 1981, so the loops
    were fused across rows to fill vectors, and each lane gathered its channel's mean, variance,
    weight and bias (a raw-audio net's, 1.21 ms at 25% of the memory bandwidth; 0.22 ms row by
    row, Zen 3). Each row now runs with its channel's values broadcast, its whole vectors
    vectorized (vectorize_tails) and the rows in parallel. Numbers: torch's."""
    shape = (16, 32, 1981)
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor(shape, "float32"))
    stats = [relax.Var(name, R.Tensor((32,), "float32")) for name in ("gamma", "beta", "mean", "var")]
    with bb.function("main", [x, *stats]):
        with bb.dataflow():
            normed = bb.emit(relax.op.nn.batch_norm(x, *stats, axis=1, training=False)[0])
            out = bb.emit_output(relax.op.nn.relu(normed))
        bb.emit_func_output(out)
    a = torch.randn(shape)
    gamma, beta, mean, var = torch.randn(32), torch.randn(32), torch.randn(32), torch.rand(32) + 0.5
    got, scheduled = run_relax(bb.get(), a, gamma, beta, mean, var)
    expected = torch.relu(torch.nn.functional.batch_norm(a, mean, var, gamma, beta, training=False))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    (text,) = [f.script() for f in prim_funcs(scheduled).values() if "T.vectorized(" in f.script()]
    assert "T.parallel(T.int64(512))" in text and "// T.int64(1981)" not in text, text


def test_chain_of_reshapes_and_transposes_is_tiled_as_one_transpose() -> None:
    """After inlining, the composed reshape indices simplify to x[s, n, h * 16 + d]: the read is
    recognized as a transpose along d and tiled (a loop of 16 rows around a vector of 16), not
    walked along s with div/mod index math per element. (An AVX-512 target, whatever the host:
    16 lanes make the tile's inner loop one vector.)"""
    shape, relax_op, _ = ELEMENTWISE["attention-key-transpose"]
    func = next(iter(prim_funcs(fuse(unary_module(shape, relax_op))).values()))
    avx512 = Target({"kind": "llvm", "mcpu": "sapphirerapids"})
    text = Elementwise().apply(func, avx512, False).mod["main"].script()
    assert "x[v_ax3, v_ax0, v_ax1 * T.int64(16) + v_ax2]" in text, text
    assert "T.grid(T.int64(16), T.int64(16))" in text, "no 16 x 16 transpose tile"


def test_a_transpose_with_a_ragged_last_column_of_tiles_is_tiled_but_for_it() -> None:
    """Keys of a ViT's attention, 65 tokens: the 16 x 16 tiles cover 64 of them; the whole
    tiles are cut off (`loop_partition`) and vectorized, the last one runs serial. Untiled, each
    read of the 64 x 32 x 65 transpose was a page from the one before: 0.49 -> 0.12 ms on Zen 3.
    Numbers: test_elementwise_rule_matches_torch[attention-key-transpose-65-tokens]."""
    shape, relax_op, _ = ELEMENTWISE["attention-key-transpose-65-tokens"]
    func = next(iter(prim_funcs(fuse(unary_module(shape, relax_op))).values()))
    avx512 = Target({"kind": "llvm", "mcpu": "sapphirerapids"})
    text = Elementwise().apply(func, avx512, False).mod["main"].script()
    # Tiles 0-3 of the 65 tokens, 16 rows around a vector of 16; then tile 4, serial.
    assert re.search(r"in T\.grid\(T\.int64\(4\), T\.int64\(16\)\):\s+for \w+ in T\.vectorized\(T\.int64\(16\)\)", text), text
    assert "in range(T.int64(4), T.int64(5)):" in text, text


def _split_gradient(widths: tuple[int, ...], transposed: int | None = None) -> tvm.IRModule:
    """The gradient of a split along the last axis as autodiff writes it: each part padded to
    the whole width, the padded parts added. Part `transposed` comes in as (width, rows)."""
    rows, total = 1040, sum(widths)
    bb = relax.BlockBuilder()
    parts = [relax.Var(f"d{i}", R.Tensor((w, rows) if i == transposed else (rows, w), "float32"))
             for i, w in enumerate(widths)]
    with bb.function("main", parts):
        with bb.dataflow():
            out, start = None, 0
            for i, (part, w) in enumerate(zip(parts, widths)):
                value = relax.op.permute_dims(part) if i == transposed else part
                padded = relax.op.nn.pad(value, [0, 0, start, total - start - w])
                out = padded if out is None else relax.op.add(out, padded)
                start += w
            result = bb.emit_output(out)
        bb.emit_func_output(result)
    return bb.get()


def test_a_split_gradient_runs_one_vector_loop_per_part() -> None:
    """A fused QKV projection's gradient (dq, dk, dv padded to 384 columns and added; dk read
    transposed): every lane of a vector takes its own branch, so the kernel ran serial (a ViT's
    1040 x 384, 351 us on Zen 3). Cut at 128 and 256, each part is one vectorized loop
    (72 us). Numbers: torch.cat's, exactly."""
    widths = (128, 128, 128)
    parts = [torch.randn(1040, 128), torch.randn(128, 1040), torch.randn(1040, 128)]
    func = next(iter(prim_funcs(fuse(_split_gradient(widths, transposed=1))).values()))
    text = Elementwise().apply(func, TARGET, False).mod["main"].script()
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    for lo, hi in ((128, 256), (256, 384)):  # the first part's loop starts at 0: range(n)
        assert f"in range(T.int64({lo // lanes}), T.int64({hi // lanes})):" in text, text
    assert text.count("T.vectorized(") == 3, text
    got, _ = run_relax(_split_gradient(widths, transposed=1), *parts)
    torch.testing.assert_close(got, torch.cat([parts[0], parts[1].T, parts[2]], dim=1), rtol=0, atol=0)


def test_a_one_dimensional_concatenation_stays_one_parallel_loop() -> None:
    """With no rows to run in parallel, cutting the one loop would leave it serial: a 1-D
    concatenation (2^18 + 2^18 floats) keeps the spatial schedule. Numbers: torch.cat's."""
    bb = relax.BlockBuilder()
    parts = [relax.Var(f"p{i}", R.Tensor((1 << 18,), "float32")) for i in range(2)]
    with bb.function("main", parts):
        with bb.dataflow():
            out = bb.emit_output(relax.op.concat(parts, axis=0))
        bb.emit_func_output(out)
    a, b = torch.randn(1 << 18), torch.randn(1 << 18)
    got, scheduled = run_relax(bb.get(), a, b)
    torch.testing.assert_close(got, torch.cat([a, b]), rtol=0, atol=0)
    for func in prim_funcs(scheduled).values():
        assert_scheduled(func)


@pytest.mark.parametrize("widths", [(65, 63), (8, 120)], ids=["cut-inside-a-vector", "cut-on-a-vector"])
def test_a_split_gradient_is_cut_only_where_vectors_meet(widths) -> None:
    """A cut inside a vector (65 + 63) would leave lanes on both sides of it: that block is left
    to the spatial schedule. 8 + 120 is cut. Numbers: torch.cat's either way."""
    from tvmgraph.schedules.loops import inline_spatial_blocks, root_blocks
    from tvmgraph.schedules.piecewise import schedule_piecewise
    from tvmgraph.schedules.unchecked import Schedule

    func = next(iter(prim_funcs(fuse(_split_gradient(widths))).values()))
    sch = Schedule(func)
    inline_spatial_blocks(sch)
    (block,) = root_blocks(sch)
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    assert schedule_piecewise(sch, block, lanes) == all(w % lanes == 0 for w in widths)
    parts = [torch.randn(1040, w) for w in widths]
    got, _ = run_relax(_split_gradient(widths), *parts)
    torch.testing.assert_close(got, torch.cat(parts, dim=1), rtol=0, atol=0)


@I.ir_module
class SGDMomentum:
    @R.function
    def main(p: R.Tensor((1024, 784), "float32"), g: R.Tensor((1024, 784), "float32"),
             buf: R.Tensor((1024, 784), "float32"), lr: R.Tensor((), "float32"),
             momentum: R.Tensor((), "float32")):
        with R.dataflow():
            new_buf = R.add(R.multiply(momentum, buf), g)
            new_p = R.subtract(p, R.multiply(lr, new_buf))
            out = (new_p, new_buf)
            R.output(out)
        return out


def test_sgd_momentum_update_is_parallel_and_vectorized() -> None:
    """The optimizer update of a 1024x784 weight: one fused, parallel, vectorized kernel."""
    p, g, buf = torch.randn(1024, 784), torch.randn(1024, 784), torch.randn(1024, 784)
    lr, mom = torch.tensor(0.1), torch.tensor(0.9)
    with TARGET:
        scheduled = ApplyCPUSchedules()(fuse(SGDMomentum))
    vm = relax.VirtualMachine(finish(scheduled), tvm.cpu())
    new_p, new_buf = vm["main"](*[tvm.runtime.tensor(t.numpy()) for t in (p, g, buf, lr, mom)])
    expected_buf = mom * buf + g
    torch.testing.assert_close(torch.from_numpy(new_buf.numpy()), expected_buf, **TOL)
    torch.testing.assert_close(torch.from_numpy(new_p.numpy()), p - lr * expected_buf, **TOL)
    for func in prim_funcs(scheduled).values():
        assert_scheduled(func)


FAST = {
    # name: (rewrite, reference, input range, absolute tolerance, relative tolerance)
    "exp": (fast_exp, np.exp, (-87.0, 88.72), 0.0, 3e-7),
    "erf": (fast_erf, None, (-6.0, 6.0), 1e-6, 0.0),
    "tanh": (fast_tanh, np.tanh, (-12.0, 12.0), 1e-6, 0.0),
    "sigmoid": (fast_sigmoid, None, (-30.0, 30.0), 1e-6, 0.0),
}


@pytest.mark.parametrize("name", FAST.keys())
def test_fast_math_accuracy(name: str) -> None:
    """The polynomial exp/erf/tanh/sigmoid meet the accuracy fast_math.py documents."""
    rewrite, reference, (lo, hi), atol, rtol = FAST[name]
    x = te.placeholder((8192,), name="x")
    y = te.compute(x.shape, lambda i: rewrite(x[i]), name="y")
    lib = tvm.compile(te.create_prim_func([x, y]), target=TARGET)
    data = np.linspace(lo, hi, 8192, dtype="float32")
    out = tvm.runtime.tensor(np.zeros(8192, "float32"))
    lib["main"](tvm.runtime.tensor(data), out)
    exact = {
        "erf": lambda v: torch.erf(torch.from_numpy(v).double()).numpy(),
        "sigmoid": lambda v: torch.sigmoid(torch.from_numpy(v).double()).numpy(),
    }.get(name) or (lambda v: reference(v.astype("float64")))
    np.testing.assert_allclose(out.numpy(), exact(data), atol=atol, rtol=rtol)


def test_fast_exp_of_minus_infinity_is_zero() -> None:
    """Masked softmax feeds -inf to exp: the fast exp returns exactly 0 there."""
    x = te.placeholder((16,), name="x")
    y = te.compute(x.shape, lambda i: fast_exp(x[i]), name="y")
    lib = tvm.compile(te.create_prim_func([x, y]), target=TARGET)
    out = tvm.runtime.tensor(np.ones(16, "float32"))
    lib["main"](tvm.runtime.tensor(np.full(16, -np.inf, "float32")), out)
    assert (out.numpy() == 0.0).all()


def test_fast_exp_is_finite_up_to_floats_largest_and_inf_past_it() -> None:
    """exp(88.5) is 2.7e38, finite in float32: the clamp at TOPI's 88.376 made n = 128 there, and
    the bit-built 2^128 sent x in [88.376, 88.72] to inf. Past ln(3.4e38), inf as in torch."""
    data = np.array([88.38, 88.5, 88.7, 88.72, 88.73, 89.0, 1e30, np.inf] * 2, "float32")
    x = te.placeholder((16,), name="x")
    y = te.compute(x.shape, lambda i: fast_exp(x[i]), name="y")
    lib = tvm.compile(te.create_prim_func([x, y]), target=TARGET)
    out = tvm.runtime.tensor(np.zeros(16, "float32"))
    lib["main"](tvm.runtime.tensor(data), out)
    np.testing.assert_allclose(out.numpy(), torch.exp(torch.from_numpy(data)).numpy(), rtol=3e-7)


def test_a_fast_function_reads_its_argument_once() -> None:
    """The polynomials read their argument up to 20 times. Written out, a GRU cell's tanh of a
    product with a sigmoid held the sigmoid's argument hundreds of times over, and each such
    kernel took 1.5 s to build (a 2-layer GRU over 32 steps: 35 s to its first call).
    Bound to a variable (a Let), each argument appears once; the numbers stay torch's."""
    x, y = te.placeholder((64,), name="x"), te.placeholder((64,), name="y")
    out = te.compute(x.shape, lambda i: fast_tanh(x[i] * fast_sigmoid(x[i] + y[i]) + fast_erf(y[i] - x[i])),
                     name="out")
    func = te.create_prim_func([x, y, out])
    text = func.script()
    assert text.count("x[v_i] + y[v_i]") == 1 and text.count("y[v_i] - x[v_i]") == 1, text
    assert len(text) < 4000, len(text)
    lib = tvm.compile(func, target=TARGET)
    a, b = torch.randn(64) * 3, torch.randn(64) * 3
    result = tvm.runtime.tensor(np.zeros(64, "float32"))
    lib["main"](tvm.runtime.tensor(a.numpy()), tvm.runtime.tensor(b.numpy()), result)
    expected = torch.tanh(a * torch.sigmoid(a + b) + torch.erf(b - a))
    torch.testing.assert_close(torch.from_numpy(result.numpy()), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("input_dtype", ["bfloat16", "float32"])
def test_a_kernel_holding_bfloat16_repeats_arguments(input_dtype: str) -> None:
    """TVM 0.27's bfloat16 legalization and a Let made LLVM codegen fail ("BF16 needs to be
    storaged lowered first") or compute wrong numbers: every CPU autocast graph with an exp.
    In a kernel that holds any bfloat16 the arguments are written out, as before the Let."""
    x = te.placeholder((64,), name="x", dtype=input_dtype)
    out = te.compute(x.shape, lambda i: tvm.tirx.exp(x[i].astype("float32") * 2.0).astype("bfloat16"),
                     name="out")
    func = use_fast_math(te.create_prim_func([x, out]))
    text = func.script()
    assert "T.reinterpret" in text and "T.Let" not in text and text.count("x[v_i]") > 2, text
    lib = tvm.compile(func, target=TARGET)
    a = (torch.randn(64) * 3).to(getattr(torch, input_dtype))
    actual = torch.zeros(64, dtype=torch.bfloat16)
    lib["main"](tvm.runtime.from_dlpack(a), tvm.runtime.from_dlpack(actual))
    torch.testing.assert_close(actual, (a.float() * 2).exp().to(torch.bfloat16), atol=0, rtol=1e-2)


# ---- apply.py: the pass itself ---------------------------------------------------------------


class _Exploding(Matmul):
    """A rule that fails on everything (stands for a rule bug)."""

    def apply(self, func, target, tunable):  # noqa: ANN001, ANN201
        raise tvm.TVMError("boom")


def test_a_failing_rule_falls_through_to_the_next() -> None:
    """A rule that raises costs only its schedule: the next rule schedules the function."""
    func = te_matmul(16, 32, 8, False, False)
    with TARGET:
        mod = ApplyCPUSchedules(_Exploding(), Fallback())(tvm.IRModule({"main": func}))
    assert bool(mod["main"].attrs["tirx.is_scheduled"])


class _Buggy(Matmul):
    """A rule whose own Python fails (a bug, not TVM refusing a primitive)."""

    def apply(self, func, target, tunable):  # noqa: ANN001, ANN201
        return {}["tile"]


class _Refused(Matmul):
    """A rule that asks TVM for a block the kernel does not have: TVM's own check refuses."""

    def apply(self, func, target, tunable):  # noqa: ANN001, ANN201
        sch = tvm.s_tir.Schedule(func)
        sch.get_sblock("no_such_block")
        return sch


def test_strict_schedules_raise_a_rule_bug_and_pass_on_what_tvm_refuses() -> None:
    """With `strict` (TVMGRAPH_STRICT_SCHEDULES=1, set by the tests), a rule's own bug raises
    instead of leaving the kernel to a slower rule unnoticed; TVM refusing a primitive stays
    what it is, a rule that does not fit, and the next rule schedules the kernel."""
    mod = tvm.IRModule({"main": te_matmul(16, 32, 8, False, False)})
    with TARGET:
        with pytest.raises(KeyError, match="tile"):
            ApplyCPUSchedules(_Buggy(), Fallback(), strict=True)(mod)
        for rule, strict in ((_Buggy(), False), (_Refused(), True), (_Refused(), False)):
            scheduled = ApplyCPUSchedules(rule, Fallback(), strict=strict)(mod)
            assert bool(scheduled["main"].attrs["tirx.is_scheduled"]), (rule, strict)


@pytest.mark.parametrize("shape", [(5, 5), (3, 24, 40)])
def test_a_gram_matrix_reading_one_buffer_twice_keeps_the_schedules(shape: tuple[int, ...],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """`x @ x.mT` (a Gram matrix: cdist, a style loss, `a @ a.mT + I` before a Cholesky) is a
    matmul block whose two operands are one buffer, read through one region; the matmul rules'
    operand check indexed a second region and raised IndexError, which under strict schedules
    (the tests) cost the graph every CPU schedule (a warning, then a build without them)."""
    from tests.conftest import Fn, ModuleGraph

    values = torch.randn(*shape)
    with caplog.at_level(logging.WARNING, logger="tvmgraph"):
        got = ModuleGraph(Fn(lambda a: a @ a.mT + 1.0))(values)
    assert "ApplyCPUSchedules raised" not in caplog.text
    torch.testing.assert_close(got, values @ values.mT + 1.0, atol=1e-4, rtol=1e-4)


def test_a_sum_of_a_broadcast_scalar_keeps_the_schedules(caplog: pytest.LogCaptureFixture) -> None:
    """`s.expand(4).sum()` of a 0-d `s` (autodiff emits it for the gradient of a scalar used
    by every row, a flow's log-determinant under AMP) reduces a block whose only read has no
    axis; the reduction rule indexed its last axis (IndexError), which under strict schedules
    (the tests) cost the graph every CPU schedule."""
    from tests.conftest import Fn, ModuleGraph

    scalar = torch.tensor(1.5)
    with caplog.at_level(logging.WARNING, logger="tvmgraph"):
        got = ModuleGraph(Fn(lambda s: s.expand(4).sum() * -1.0))(scalar)
    assert "ApplyCPUSchedules raised" not in caplog.text
    torch.testing.assert_close(got, torch.tensor(-6.0))


def test_a_failing_gpu_rule_falls_through_to_the_next() -> None:
    """The same for dlight's GPU rules (TVM 0.27's Reduction rule raised inside rfactor on a
    float16 AMP step and ended its CUDA build): the kernel gets the next rule's schedule."""
    from tvm.s_tir import dlight as dl

    func = te_matmul(16, 32, 8, False, False)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        mod = ApplyGPUSchedules(_Exploding(), dl.gpu.Fallback())(tvm.IRModule({"main": func}))
    assert bool(mod["main"].attrs["tirx.is_scheduled"])
    assert "threadIdx.x" in mod["main"].script()


class _Counting(Matmul):
    """The matmul rule, counting the kernels it is tried on."""

    def __init__(self) -> None:
        super().__init__()
        self.tried: list[str] = []

    def apply(self, func, target, tunable):  # noqa: ANN001, ANN201
        self.tried.append(func.script())
        return super().apply(func, target, tunable)


def test_reduction_rules_are_tried_on_kernels_with_a_reduction_only() -> None:
    """A rule with `needs_reduction` is skipped on an element-wise kernel and tried on a matmul."""
    counting = _Counting()
    x = te.placeholder((64, 64), name="x")
    relu = te.create_prim_func([x, te.compute((64, 64), lambda i, j: tvm.tirx.max(x[i, j], 0.0), name="y")])
    with TARGET:
        scheduled = ApplyCPUSchedules(counting, Fallback())(tvm.IRModule({"main": relu}))
        assert counting.tried == [] and bool(scheduled["main"].attrs["tirx.is_scheduled"])
        ApplyCPUSchedules(counting, Fallback())(tvm.IRModule({"main": te_matmul(16, 32, 8, False, False)}))
    assert len(counting.tried) == 1


def test_rules_that_need_a_reduction_schedule_no_element_wise_kernel() -> None:
    """What skipping them relies on: each default rule with `needs_reduction` returns None on
    kernels without a reduction block (a chain of element-wise blocks, a transpose, a pad)."""
    from tvmgraph.schedules import default_rules

    x = te.placeholder((8, 16, 32), name="x")
    y = te.compute(x.shape, lambda a, b, c: x[a, b, c] * 2.0, name="y")
    chain = te.create_prim_func([x, te.compute(x.shape, lambda a, b, c: tvm.tirx.exp(y[a, b, c]), name="z")])
    transpose = te.create_prim_func([x, te.compute((32, 16, 8), lambda a, b, c: x[c, b, a], name="t")])
    pad = te.create_prim_func([x, te.compute((8, 18, 34), lambda a, b, c: tvm.tirx.if_then_else(
        tvm.tirx.all(b >= 1, b <= 16, c >= 1, c <= 32), x[a, b - 1, c - 1], 0.0), name="p")])
    rules = [rule for rule in default_rules() if getattr(rule, "needs_reduction", False)]
    assert {type(rule).__name__ for rule in rules} == {
        "ConvWeightGradient", "Conv2d", "Conv1d", "MatrixVector", "Matmul", "Reduction"}
    for func in (chain, transpose, pad):
        for rule in rules:
            assert rule.apply(func, TARGET, False) is None, type(rule).__name__


def test_rules_that_need_one_binary_reduction_skip_other_reductions() -> None:
    """A matmul rule (`needs_binary_reduction`) is not tried on a sum (one read) nor on a kernel
    of two reductions; it is on a matmul."""
    from tvmgraph.schedules.apply import KernelFacts

    counting = _Counting()
    x = te.placeholder((64, 64), name="x")
    k = te.reduce_axis((0, 64), "k")
    total = te.create_prim_func([x, te.compute((64,), lambda i: te.sum(x[i, k], axis=k), name="s")])
    k2 = te.reduce_axis((0, 64), "k2")
    s = te.compute((64,), lambda i: te.sum(x[i, k2], axis=k2), name="s")
    k3 = te.reduce_axis((0, 64), "k3")
    two = te.create_prim_func([x, te.compute((64,), lambda i: te.max(x[i, k3] - s[i], axis=k3), name="m")])
    with TARGET:
        for func in (total, two):
            ApplyCPUSchedules(counting, Fallback())(tvm.IRModule({"main": func}))
        assert counting.tried == []
        ApplyCPUSchedules(counting, Fallback())(tvm.IRModule({"main": te_matmul(16, 32, 8, False, False)}))
    assert len(counting.tried) == 1
    assert KernelFacts.of(total) == KernelFacts(True, False, frozenset({"s"}))
    assert not KernelFacts.of(two).binary_reduction and KernelFacts.of(two).reduces


def test_skipped_rules_schedule_no_kernel_they_are_skipped_on() -> None:
    """What skipping them relies on: a rule with `needs_binary_reduction` returns None on a sum,
    a softmax-like pair of reductions and a batch norm's statistics; one with `needs_block`
    returns None on a matmul (which has no block of that name)."""
    from tvmgraph.schedules import default_rules
    from tvmgraph.schedules.apply import KernelFacts

    x = te.placeholder((8, 16, 32), name="x")
    ka = te.reduce_axis((0, 32), "ka")
    total = te.create_prim_func([x, te.compute((8, 16), lambda a, b: te.sum(x[a, b, ka], axis=ka), name="s")])
    kb = te.reduce_axis((0, 32), "kb")
    m = te.compute((8, 16), lambda a, b: te.max(x[a, b, kb], axis=kb), name="m")
    kc = te.reduce_axis((0, 32), "kc")
    softmax_sum = te.create_prim_func([x, te.compute((8, 16), lambda a, b: te.sum(tvm.tirx.exp(x[a, b, kc] - m[a, b]),
                                                                                 axis=kc), name="z")])
    n, c = te.reduce_axis((0, 8), "n"), te.reduce_axis((0, 32), "c")
    squares = te.create_prim_func([x, te.compute((16,), lambda b: te.sum(x[n, b, c] * x[n, b, c], axis=[n, c]),
                                                 name="sq")])
    matmul = te_matmul(16, 32, 8, False, False)
    rules = default_rules()
    binary = [r for r in rules if getattr(r, "needs_binary_reduction", False)]
    named = [r for r in rules if getattr(r, "needs_block", None)]
    assert {type(r).__name__ for r in binary} == {"ConvWeightGradient", "Conv2d", "MatrixVector", "Matmul"}
    assert {type(r).__name__ for r in named} == {"Conv1d", "Im2col"}
    for func in (total, softmax_sum, squares):
        assert not KernelFacts.of(func).binary_reduction
        for rule in binary:
            assert rule.apply(func, TARGET, False) is None, type(rule).__name__
    for rule in named:
        assert not KernelFacts.of(matmul).admits(rule)
        assert rule.apply(matmul, TARGET, False) is None, type(rule).__name__


def test_scheduled_functions_and_foreign_targets_are_left_alone() -> None:
    """is_scheduled functions are untouched; without an llvm target the pass does nothing."""
    func = te_matmul(16, 32, 8, False, False)
    marked = tvm.IRModule({"main": func.with_attr("tirx.is_scheduled", True)})
    with TARGET:
        tvm.ir.assert_structural_equal(ApplyCPUSchedules()(marked), marked)
    plain = tvm.IRModule({"main": func})
    tvm.ir.assert_structural_equal(ApplyCPUSchedules()(plain), plain)


def test_fallback_schedules_what_no_rule_matches() -> None:
    """A reduction under a non-injective output (argmax's index) still gets threads/vectors."""
    mod = unary_module((512, 1024), lambda x: relax.op.argmax(x, axis=1))
    func = next(iter(prim_funcs(fuse(mod)).values()))
    with TARGET:
        scheduled = ApplyCPUSchedules(Fallback())(tvm.IRModule({"main": func}))["main"]
    assert_scheduled(scheduled, vector=False)
    x = torch.randn(512, 1024)
    out, _ = run_relax(mod, x)
    torch.testing.assert_close(out, x.argmax(1))


def test_schedule_is_deterministic() -> None:
    """Scheduling the same module twice gives structurally equal results (cacheable)."""
    mod = fuse(LinearLayer)
    with TARGET:
        first, second = ApplyCPUSchedules()(mod), ApplyCPUSchedules()(mod)
    tvm.ir.assert_structural_equal(first, second)


@pytest.mark.parametrize("case", ["encoder", "cnn"])
def test_no_rule_fails_on_a_training_step(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every kernel of a transformer's and a CNN's training step is scheduled by a rule that
    matched it without raising. A rule that raises passes the kernel to the next rule (right
    numbers, slower code, a debug line only): that hid a broken epilogue check (the matmul rule
    raised on every kernel with an epilogue it could not inline) and `mean` to one value (the
    reduction rule raised, one serial chain of additions ran)."""
    torch.manual_seed(0)
    if case == "encoder":
        model = nn.Sequential(EncoderBlock(d_model=32), EncoderBlock(d_model=32))
        x, y, loss = torch.randn(4, 16, 32), torch.randn(4, 16, 32), nn.MSELoss()
    else:
        model = SmallCNN()
        x, y, loss = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)), nn.CrossEntropyLoss()
    graph = TrainGraph(model.train(), loss, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    with caplog.at_level(logging.DEBUG, logger="tvmgraph.schedules.apply"):
        graph(x, y)
    assert "ApplyCPUSchedules: scheduled" in caplog.text
    failed = [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]
    assert not failed, failed


@pytest.mark.parametrize("shape, kernel, stride, padding, dilation, batch_inside", [
    ((2, 5, 8, 8), 3, 1, 1, 1, False),    # ResNet-18's 8x8 layers: one 8-lane row per vector
    ((2, 3, 4, 4), 3, 1, 1, 1, True),     # a weight gradient's copy, the batch inside
    ((2, 4, 16, 16), 3, 2, 1, 1, False),  # strided: 16x16 -> 8x8
    ((1, 3, 7, 7), 3, 1, 1, 1, False),    # rows of 7: a 7-lane vector
    ((1, 2, 40, 40), 3, 1, 1, 1, False),  # rows of 40: vectors of 8 on AVX2, serial on AVX-512
    ((2, 3, 9, 9), 3, 1, 2, 2, False),    # dilated: one 9-lane vector on AVX-512, serial on AVX2
])
def test_im2col_copies_one_output_row_per_vector(shape: tuple, kernel: int, stride: int, padding: int,
                                                  dilation: int, batch_inside: bool) -> None:
    """relay_passes/im2col_conv.py's window copy (schedules/im2col.py): parallel over the first two
    axes, one vector per output row. The element-wise rule cut vectors across rows, each then
    loaded lane by lane (ResNet-18's copies at 41-53% of the copy bandwidth, 2-3.7x slower).
    Equal to torch's unfold, zeros where the window leaves the image."""
    from relay_passes.im2col_conv import _im2col

    n, c, h, w = shape
    out = (h + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    x = te.placeholder(shape, "float32", "x")
    cols = _im2col(x, (kernel, kernel), [stride] * 2, [padding] * 2, [dilation] * 2, (out, out), batch_inside)
    func = te.create_prim_func([x, cols])
    data = torch.randn(shape)
    got, scheduled = run_prim_func(func, data, out_shape=tuple(int(d) for d in cols.shape))
    want = torch.nn.functional.unfold(data, kernel, dilation=dilation, padding=padding, stride=stride)
    want = want.reshape(n, c, kernel, kernel, out, out)
    if batch_inside:
        want = want.permute(1, 2, 3, 0, 4, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    text = scheduled.script()
    assert "T.parallel(" in text
    vectors = re.findall(r"in T\.vectorized\((?:T\.int64\()?(\d+)", text)
    # A row in one vector where it fits, else in whole vectors where they divide it.
    lanes = CPUTarget.from_target(TARGET).lanes("float32")
    assert vectors == ([str(out)] if out <= lanes else [str(lanes)] if out % lanes == 0 else []), text


def test_a_recurrence_that_reads_each_step_twice_schedules_without_blowing_up() -> None:
    """`h = sigmoid(h) * h + x[:, t]` in a Python loop is one fused element-wise kernel whose
    steps each read the previous one several times; inlining every step copied the expression
    into each read (exponential in the steps: 8 never finished scheduling). When a block of
    more than loops.MAX_COPIED_NODES nodes is read more than once, the rules give the kernel up
    and it is built as written; the numbers are eager's. In a subprocess, so that a regression
    fails instead of hanging."""
    program = textwrap.dedent("""
        import torch
        from tests.conftest import Fn, ModuleGraph

        def recurrence(x):
            h = x[:, 0]
            for t in range(1, x.shape[1]):
                h = torch.sigmoid(h) * h + x[:, t]
            return h

        x = torch.randn(4, 16, 8)
        print((ModuleGraph(Fn(recurrence))(x) - recurrence(x)).abs().max().item())
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        done = subprocess.run([sys.executable, "-c", program], cwd=root, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("16 steps of the recurrence did not compile within 180 s")
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 1e-5
    # The refusal is the rules' own, not a failed pass (which under strict schedules, as here,
    # compiled the whole graph without its schedules).
    assert "ApplyCPUSchedules raised" not in done.stderr, done.stderr[-2000:]


def test_has_more_nodes_stops_at_the_limit() -> None:
    from tvmgraph.schedules.loops import _has_more_nodes

    x = tirx.Var("x", "float32")
    expr = x
    for _ in range(30):
        expr = expr * expr + x  # a tree of 2^30 leaves: counting stops at the limit
    assert _has_more_nodes(expr, 100) and not _has_more_nodes(x + x, 100)
