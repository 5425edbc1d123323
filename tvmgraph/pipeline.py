"""Named Relax pass pipelines, one per target kind, built as a straight line of steps.

`get_pipeline(target)` returns the pipeline `CompiledGraph` uses. A pipeline is a function of
the target and the graph's config returning the list of its passes; register a new one with
`@register_pipeline("name")` and select it with `get_pipeline(target, name=...)`.

The `Pipeline` it returns runs the passes one by one (`run_pass`). With checks on, every
result must pass `relax.analysis.well_formed`. One of tvmgraph's own optimization passes
that raises or leaves an ill-formed module is left out of that graph's compile with one
warning naming the option that turns it off; any other pass that fails raises `PassError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import tvm
from tvm import relax

from . import max_pool_forward  # noqa: F401  (registers max pooling from -inf, a whole plane as a reduction)
from . import legalize_fixes  # noqa: F401  (registers the legalizations that replace failing ones)
from . import max_pool_backward  # noqa: F401  (registers non-overlapping max pooling's gradient)
from . import ragged_sums  # noqa: F401  (registers sums along rows no vector divides, cut in two)
from . import one_value_sums  # noqa: F401  (registers sums to one value kept as ones, as 0-d sums)
from . import take_backward  # noqa: F401  (registers a parallel embedding gradient)
from .config import CompileOptions, GraphConfig, compile_options, settings
from .debug import logger
from .errors import PassError, reason_of
from .native_output import to_debug_log

if TYPE_CHECKING:
    from autotune.log import AppliedLog

Report = Callable[[str], None]  # where passes say what they did (graph.debug(1))
# (target, options, report, tuning log or None) -> passes
PipelineFn = Callable[..., list[tvm.transform.Pass]]
PIPELINE_MAP: dict[str, PipelineFn] = {}

# tvmgraph's own optimization passes: one that fails is left out of the graph's compile (the
# program is right without it, only slower), and the warning says how to leave it out for good.
OPTIONAL_PASSES: dict[str, str | None] = {
    "CheckpointModules": "graph.<module>.to(tvmgraph.nn.GraphModule).activation_checkpointing = False",
    "RecomputeAttention": "graph.config.enable_recompute_attention(False)",
    "FuseModelUpdate": "graph.config.allow_fuse_model_update_ops(False)",
    "FoldConstantTables": None,
    "AccumulateFloat32": None,
    "SimplifyBroadcastMatmul": None,
    "SimplifyPower": None,
    "GramOperandsApart": None,
    "ZeroOperands": None,
    "AttentionAsOneKernel": None,
    "SafeSoftmaxAsOneKernel": None,
    "PadRaggedSoftmax": None,
    "SplitAsSlices": None,
    "StackStepGradients": None,
    "UnitSumsAsReshapes": None,
    "RecomputeLateReads": None,
    "Im2colConv": None,
    "InferenceBatchNormAsScale": None,
    "FuseEpilogue": "graph.config.allow_fuse_add_to_output(False)",
    "FuseCastScale": "graph.config.allow_fuse_cast_scale(False)",
    "tvmgraph.ApplyTuningLog": "graph.config.enable_tuning(False) or TVMGRAPH_TUNING=off",
    "tvmgraph.ApplyCPUSchedules": "the environment variable TVMGRAPH_CPU_SCHEDULES=0",
    "MarkPackedWeights": "graph.config.enable_frozen_weights(False)",
    "LiftFrozenComputation": "graph.config.enable_frozen_weights(False)",
    "StraightenBindings": "graph.config.enable_straighten_algorithm(False)",
    "CompressMemory": "graph.config.enable_compress_memory(False)",
}


def register_pipeline(name: str) -> Callable[[PipelineFn], PipelineFn]:
    """Decorator: make a pipeline available under `name`."""

    def register(fn: PipelineFn) -> PipelineFn:
        if name in PIPELINE_MAP:
            raise ValueError(f"pipeline {name!r} is already registered")
        PIPELINE_MAP[name] = fn
        return fn

    return register


def get_pipeline(target: tvm.target.Target, config: CompileOptions | GraphConfig, name: str = "default",
                 report: Report | None = None, graph: str = "graph", checks: bool | None = None,
                 tuning: AppliedLog | None = None) -> Pipeline:
    """The pass pipeline `name` for `target` and the compile options (a GraphConfig is read
    through its snapshot); an unknown name lists the registered ones.
    Passes report what they did through `report` (the graph's debug log at v_level 1); with
    `checks` (default: `settings.check_passes`) every pass's result must be well formed.
    `graph` names the graph in warnings and errors. `tuning`: the records of the graph's
    tuning log that the tuning stage applies (autotune/log.py), None for none."""
    if name not in PIPELINE_MAP:
        raise ValueError(f"unknown pipeline {name!r}; registered pipelines: {sorted(PIPELINE_MAP)}")
    passes = PIPELINE_MAP[name](target, compile_options(config), report or (lambda msg: None), tuning)
    return Pipeline(name, passes, target, graph, settings.check_passes if checks is None else checks)


class Pipeline:
    """The passes of one pipeline for one graph; calling it runs them in order on a module.

    NOTE: a Python loop, not one TVM Sequential: PassError must reach the caller as raised,
    and an exception that crosses TVM's FFI comes back as a plain RuntimeError.
    """

    __slots__ = ("name", "passes", "target", "graph", "check")

    def __init__(self, name: str, passes: list[tvm.transform.Pass], target: tvm.target.Target,
                 graph: str, check: bool):
        self.name, self.passes, self.target, self.graph, self.check = name, passes, target, graph, check

    def until(self, pass_name: str) -> Pipeline:
        """The passes before the one named `pass_name` (the tuner runs the pipeline up to its
        tuning stage to see the kernels that stage would schedule)."""
        names = [p.info.name for p in self.passes]
        if pass_name not in names:
            raise ValueError(f"pipeline {self.name!r} has no pass {pass_name!r}")
        return Pipeline(self.name, self.passes[:names.index(pass_name)], self.target, self.graph, self.check)

    def __call__(self, mod: tvm.IRModule) -> tvm.IRModule:
        problem = _ill_formed(mod) if self.check else None
        if problem is not None:
            raise PassError(f"{self.graph}: the lowered module is not well formed before the first pass "
                            f"of pipeline {self.name!r} ({problem}); this is a bug in tvmgraph's "
                            f"lowering, please report it with the graph's build()")
        with self.target:
            for p in self.passes:
                mod = run_pass(p, mod, self.graph, self.check)
        return mod


def run_pass(p: tvm.transform.Pass, mod: tvm.IRModule, graph: str, check: bool) -> tvm.IRModule:
    """`p(mod)`. With `check`, a result must also be well formed; if it is not, or `p` raises,
    an optional pass (OPTIONAL_PASSES) is left out with one warning (`mod` is returned as it
    was) and any other raises PassError. Without, `p` runs plain (a failing compile is rerun
    with checks, see LoweredGraph.build, so that nothing is warned twice)."""
    if not check:
        return _apply(p, mod)
    name = p.info.name
    try:
        out = _apply(p, mod)
    except Exception as e:  # a pass may raise anything; TVM's errors come as several types
        problem, cause = f"raised {type(e).__name__}: {reason_of(e)}", e
    else:
        problem, cause = _ill_formed(out), None
        if problem is None:
            return out
    if name not in OPTIONAL_PASSES:
        raise PassError(f"{graph}: pass {name} {problem}. The compile cannot do without this pass; "
                        f"please report this with the graph's build()") from cause
    option = OPTIONAL_PASSES[name]
    fix = f"turn it off with {option}" if option else "it has no option to turn it off"
    logger.warning("%s: pass %s %s; compiling this graph without it (%s; please report this).",
                   graph, name, problem, fix)
    return mod


def _apply(p: tvm.transform.Pass, mod: tvm.IRModule) -> tvm.IRModule:
    """`p(mod)` through Sequential, which honours the PassContext (opt_level, disabled passes).
    TVM's own passes print their warnings on fd 2 (FuseOps: "There are dead codes in the
    current IRModule, please run the DeadCodeElimination Pass"), which go to the debug log;
    tvmgraph's (Python classes, `transform_module`) report through logging, left as it is."""
    if hasattr(p, "transform_module"):
        return tvm.transform.Sequential([p])(mod)
    with to_debug_log(p.info.name):
        return tvm.transform.Sequential([p])(mod)


def _ill_formed(mod: tvm.IRModule) -> str | None:
    """None for a well-formed module, else what is wrong with it."""
    try:
        relax.analysis.well_formed(mod)  # raises ValueError at the first violation
    except Exception as e:  # noqa: BLE001  (TVM's FFI errors come as several types)
        return f"left an ill-formed module ({reason_of(e)})"
    return None




def default_schedules(target: tvm.target.Target, options: CompileOptions) -> list[tvm.transform.Pass]:
    """The passes that give each kernel without a schedule its default one: dlight's rules on
    GPU (every GPU kernel needs thread bindings), tvmgraph's CPU rules on LLVM."""
    from .schedules import ApplyCPUSchedules, ApplyGPUSchedules

    if target.kind.name == "cuda":
        return [ApplyGPUSchedules()]

    return [ApplyCPUSchedules(fast_math=options.fast_math, strict=settings.strict_schedules)] \
        if options.cpu_schedules else []


@register_pipeline("default")
def default_pipeline(target: tvm.target.Target, config: CompileOptions, report: Report,
                     tuning: AppliedLog | None = None) -> list[tvm.transform.Pass]:
    """Legalize, fuse, schedule and lower a Relax module to VM code for `target`.

    The same steps as TVM's per-target pipelines (relax/backend/*/pipeline.py), listed here so
    that tvmgraph's own passes have visible places to go.
    """
    # NOTE: relay_passes and autotune import tvmgraph, so they are imported here, not at module level.
    from autotune.apply import ApplyTuningLog
    from relay_passes.accumulate_float32 import AccumulateFloat32
    from relay_passes.bilinear_upsample import BilinearUpsampleByTwo
    from relay_passes.compress_memory import CompressMemory
    from relay_passes.fuse_cast_scale import FuseCastScale
    from relay_passes.fuse_epilogue import FuseEpilogue
    from relay_passes.fold_constant_tables import FoldConstantTables
    from relay_passes.fuse_model_update import FuseModelUpdate
    from relay_passes.group_norm_by_parts import GroupNormByParts
    from relay_passes.pad_ragged_softmax import PadRaggedSoftmax
    from relay_passes.attention import AttentionAsOneKernel
    from relay_passes.safe_softmax import SafeSoftmaxAsOneKernel
    from relay_passes.direct_conv1d import DirectConv1d
    from relay_passes.drop_call_tuples import DropCallTuples
    from relay_passes.im2col_conv import Im2colConv
    from relay_passes.inference_batch_norm import InferenceBatchNormAsScale
    from relay_passes.legalize_once import LegalizeOnce
    from relay_passes.lstm_cell import LSTMCellAsOneKernel
    from relay_passes.lower_call_tir_with_grad import LowerCallTIRWithGrad
    from relay_passes.recompute_late_reads import RecomputeLateReads
    from relay_passes.recompute_shared_layouts import RecomputeSharedLayouts
    from relay_passes.recompute_upcasts import RecomputeUpcasts
    from relay_passes.separate_backward import SeparateBackward
    from relay_passes.share_transposes import ShareTransposes
    from relay_passes.simplify_broadcast_matmul import SimplifyBroadcastMatmul
    from relay_passes.simplify_power import SimplifyPower
    from relay_passes.gram_operands import GramOperandsApart
    from relay_passes.zero_operands import ZeroOperands
    from relay_passes.split_as_slices import SplitAsSlices
    from relay_passes.stack_step_gradients import StackStepGradients
    from relay_passes.straighten import StraightenBindings
    from relay_passes.unit_sums import UnitSumsAsReshapes
    from relay_passes.unwrap_tuple_reads import UnwrapTupleReads
    from relay_passes.weight_packing import LiftFrozenComputation, MarkPackedWeights

    from .schedules.bitwise_isnan import BitwiseIsNaN
    from .schedules.bool_order import BoolOrder
    from .schedules.division_free_bounds import DivisionFreeBounds
    from .schedules.float_division_by_zero import FloatDivisionByZero
    from .schedules.minus_infinity_pool import MinusInfinityPool
    from .schedules.offset_floordiv import OffsetFloorDiv
    from .schedules.propagate_nan import PropagateNaN, has_one_instruction_maximum
    from .schedules.safe_integer_division import SafeIntegerDivision
    from .schedules.serial_half_fills import SerialHalfFills

    T = relax.transform
    is_gpu = target.kind.name == "cuda"
    # CPU only (its Matmul rule packs weights); inference only (tvmgraph/stages.py marks the
    # frozen state of inference programs only: a training step changes its weights).
    frozen_weights = config.frozen_weights and target.kind.name == "llvm"
    return [
        # 1. Sort/scan/sampling ops to library or TIR implementations.
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        # 2. Training graphs: the optimizer update of each param group becomes one in-place
        #    kernel (allow_fuse_model_update_ops), or its Relax function is inlined.
        FuseModelUpdate(config.fuse_model_update_ops, report),
        T.InlinePrivateFunctions(),
        #    Tables that transcendental ops compute from constants alone (a rotary embedding's
        #    cos/sin of `torch.arange`) are computed once, at compile time.
        FoldConstantTables(report),
        # 3. Matmuls read broadcast operands in place (MHA's expand + bmm and its gradient);
        #    x ** 2 is x * x (MSELoss and its gradient).
        SimplifyBroadcastMatmul(report),
        SimplifyPower(report),
        #    `x @ x.T` (a Gram matrix) reads its second operand from a copy: a matmul of two buffers.
        GramOperandsApart(report),
        #    `x * 0`, `x / 0`, `0 / x` keep IEEE's inf and NaN (TVM folds the constant zero away).
        ZeroOperands(report),
        #    On the CPU, `softmax(q @ k.T) @ v` is one kernel where nothing else reads its
        #    scores; attention's softmax and its test for empty rows are one kernel, and
        #    softmax rows that no vector divides (65 tokens) are padded with -inf to whole
        #    vectors, so that their max and sum vectorize.
        *([AttentionAsOneKernel(report), SafeSoftmaxAsOneKernel(report), PadRaggedSoftmax(report)]
          if target.kind.name == "llvm" else []),
        #    bfloat16/float16 matmuls, convolutions, sums and activations compute in float32, as
        #    torch's do (after SimplifyBroadcastMatmul, whose patterns its casts would hide).
        AccumulateFloat32(report),
        #    On the CPU, convolutions on images narrower than a vector are im2col + matmul.
        *([Im2colConv(report)] if target.kind.name == "llvm" else []),
        #    On the CPU, a conv1d is computed over rows padded to whole register tiles, then
        #    cropped (its stride-s input split into s contiguous phases).
        *([DirectConv1d(report)] if target.kind.name == "llvm" else []),
        #    On the CPU, a group norm's forward pass is a mean, a variance (reductions along
        #    the last axis, vectorized) and one element-wise kernel.
        *([GroupNormByParts(report)] if target.kind.name == "llvm" else []),
        #    On the CPU, a bilinear upsampling by two (half-pixel centres) is one kernel whose
        #    taps are plain loads: at that scale every output's weights are the same.
        *([BilinearUpsampleByTwo(report)] if target.kind.name == "llvm" else []),
        #    Training steps: the backward pass redoes the forward pass's float32 casts of 16-bit
        #    activations instead of keeping them (AMP), and forward and backward passes go in
        #    separate dataflow blocks, so that fusion keeps each pass's work in its pass.
        RecomputeUpcasts(report),
        SeparateBackward(report),
        #    A checkpointed module's recomputed activation that a gradient reads late is
        #    recomputed again there instead of kept (its own dataflow block from there on).
        RecomputeLateReads(report),
        #    Training steps: a gradient summed over the steps of an unrolled loop (an RNN's
        #    recurrent weight, its input read one step at a time) is one product over the
        #    stacked steps, or one concatenation.
        StackStepGradients(report),
        #    An eval-mode batch norm is a per-channel multiply-add, which FuseEpilogue then
        #    takes into the convolution or matmul before it.
        InferenceBatchNormAsScale(report),
        #    A transpose repeated (an RNN's `h @ W_hh.T` at every time step) is computed once,
        #    so that FuseEpilogue leaves it out of the matmul kernels: one transpose, not one
        #    transposing copy of the weight per step.
        ShareTransposes(report),
        #    On the CPU, an LSTM's time step (its product, gates and states) is one kernel where
        #    nothing else reads the gates (inference).
        *([LSTMCellAsOneKernel(report)] if target.kind.name == "llvm" else []),
        #    Each matmul/conv2d is grouped with its epilogue and operand transposes
        #    (allow_fuse_add_to_output); FuseOps (step 5) fuses the rest.
        FuseEpilogue(config.fuse_add_to_output, report),
        #    A cast followed by a scalar multiply is one kernel (allow_fuse_cast_scale).
        FuseCastScale(config.fuse_cast_scale, report),
        #    A split read element-wise (an LSTM's gates) is one slice per piece, which fuses
        #    into its readers (a split's tuple fuses into none).
        SplitAsSlices(report),
        #    A sum over axes of extent 1 only (autodiff's collapse_sum of a broadcast that only
        #    added unit axes) is a reshape: a view, no kernel.
        UnitSumsAsReshapes(report),
        # 4. Every Relax op becomes a call to a TIR PrimFunc.
        LowerCallTIRWithGrad(),
        #    (TVM's LegalizeOps, a call equal to an earlier one reusing its PrimFunc.)
        LegalizeOnce(report),
        #    `(x,)[0]` (how legalized index_tensor reads its indices) becomes `x`: FuseOps lost
        #    the binding of an `x` it fused when x was read only inside such a tuple.
        UnwrapTupleReads(),
        # 4. Operator fusion: group element-wise/injective ops with their producers.
        #    (No FoldConstant: parameters are inputs, so little folds, and folding compiles and
        #    runs every constant kernel once: 4 s of a 19 s CNN training-graph compile.)
        T.AnnotateTIROpPattern(),
        #    A layout kernel (reshape, transpose, slice) that several element-wise kernels read
        #    is redone in each, so that it fuses into them (MHA's q/k/v split).
        RecomputeSharedLayouts(report),
        T.FuseOps(),
        T.FuseTIR(),
        # 5. The tuning stage: kernels the graph's tuning log has a faster schedule for get
        #    it (autotune/); then default schedules for the rest: dlight on GPU, tvmgraph's
        #    CPU rules on LLVM.
        ApplyTuningLog(tuning, report),
        #    Inference with enable_frozen_weights: what kernels compute from the weights alone
        #    (the matmuls' packed weights among it) is computed by a function of its own, run
        #    once per weight version (tvmgraph/frozen_weights.py), not on every call.
        *([MarkPackedWeights(report)] if frozen_weights else []),
        *default_schedules(target, config),
        *([LiftFrozenComputation(report)] if frozen_weights else []),
        #    A float division by a constant zero (a mean over zero rows, once the schedules
        #    inlined its count) as IEEE's inf or NaN: TVM's constant folder refuses it.
        FloatDivisionByZero(),
        #    Max, min and comparisons of booleans as logic (LLVM's code generator compares
        #    bools as floats).
        BoolOrder(),
        #    Max pooling starts from -inf and pads with it, as torch (TOPI: the lowest float).
        MinusInfinityPool(),
        #    `(x + k) // d` without its offset inside the division: TVM's FlattenBuffer
        #    simplifies `(x % c + k) // d` wrongly (a strided slice's gradient came out shifted).
        OffsetFloorDiv(),
        #    A float max/min with a NaN operand is NaN, as in torch (TVM's drops it on CPU).
        *([PropagateNaN(has_one_instruction_maximum(target))] if target.kind.name == "llvm" else []),
        #    An integer division by a zero read from a tensor gives 0 (x86's idiv trapped:
        #    SIGFPE killed the process where eager raises ZeroDivisionError).
        *([SafeIntegerDivision()] if target.kind.name == "llvm" else []),
        #    isnan (and isinf, isfinite) as a test of the bits, which vectorizes.
        *([BitwiseIsNaN()] if target.kind.name == "llvm" else []),
        #    A padded tile's bounds test under a dynamic batch without its division, which
        #    vectorizes.
        *([DivisionFreeBounds()] if target.kind.name == "llvm" else []),
        #    A vectorized bfloat16 fill (a constant store) runs serial: TVM's bfloat16
        #    legalization fails on it.
        *([SerialHalfFills()] if target.kind.name == "llvm" else []),
        #    The kernels run in an order with fewer tensors live at once
        #    (enable_straighten_algorithm). NOTE: needs dataflow blocks, so before ToNonDataflow.
        StraightenBindings(config.straighten_algorithm, report),
        # 6. Dataflow blocks become plain bindings; calls become destination-passing style.
        T.RewriteDataflowReshape(),
        T.ToNonDataflow(),
        T.RemovePurityChecking(),
        T.CallTIRRewrite(),
        # 7. Memory planning, then lowering to VM builtins. CompressMemory packs each function's
        #    intermediates into one arena (enable_compress_memory); StaticPlanBlockMemory plans
        #    the rest.
        CompressMemory(config.compress_memory, report),
        T.StaticPlanBlockMemory(),
        *([T.RewriteCUDAGraph()] if is_gpu else []),
        T.LowerAllocTensor(),
        #    On the CPU, a call's outputs are read as themselves, not through the tuple of them
        #    that CallTIRRewrite binds (a VM instruction per call of a kernel with several).
        *([DropCallTuples(report)] if target.kind.name == "llvm" else []),
        T.KillAfterLastUse(),
        T.LowerRuntimeBuiltin(),
        T.ComputePrimValue(),
        T.VMShapeLower(),
        T.AttachGlobalSymbol(),
    ]
