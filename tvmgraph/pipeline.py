"""Named Relax pass pipelines, one per target kind, built as a straight line of steps.

`get_pipeline(target)` returns the pipeline `CompiledGraph` uses. A pipeline is a function of
the target and the graph's config returning a `tvm.transform.Pass`; register a new one with
`@register_pipeline("name")` and select it with `get_pipeline(target, name=...)`.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from .config import CompileOptions, GraphConfig, compile_options

Report = Callable[[str], None]  # where passes say what they did (graph.debug(1))
PipelineFn = Callable[[tvm.target.Target, CompileOptions, Report], tvm.transform.Pass]
PIPELINE_MAP: dict[str, PipelineFn] = {}


def register_pipeline(name: str) -> Callable[[PipelineFn], PipelineFn]:
    """Decorator: make a pipeline available under `name`."""

    def register(fn: PipelineFn) -> PipelineFn:
        if name in PIPELINE_MAP:
            raise ValueError(f"pipeline {name!r} is already registered")
        PIPELINE_MAP[name] = fn
        return fn

    return register


def get_pipeline(target: tvm.target.Target, config: CompileOptions | GraphConfig, name: str = "default",
                 report: Report | None = None) -> tvm.transform.Pass:
    """The pass pipeline `name` for `target` and the compile options (a GraphConfig is read
    through its snapshot); an unknown name lists the registered ones. Passes report what they
    did through `report` (the graph's debug log at v_level 1)."""
    if name not in PIPELINE_MAP:
        raise ValueError(f"unknown pipeline {name!r}; registered pipelines: {sorted(PIPELINE_MAP)}")
    return PIPELINE_MAP[name](target, compile_options(config), report or (lambda msg: None))


def _gpu_schedules() -> list[tvm.transform.Pass]:
    from tvm.s_tir import dlight as dl

    # Every GPU kernel needs thread bindings; dlight's rules give each PrimFunc a default one.
    return [dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                    dl.gpu.GeneralReduction(), dl.gpu.Fallback())]


def _cpu_schedules(options: CompileOptions) -> list[tvm.transform.Pass]:
    from .schedules import ApplyCPUSchedules

    return [ApplyCPUSchedules(fast_math=options.fast_math)] if options.cpu_schedules else []


@register_pipeline("default")
def default_pipeline(target: tvm.target.Target, config: CompileOptions, report: Report) -> tvm.transform.Pass:
    """Legalize, fuse, schedule and lower a Relax module to VM code for `target`.

    The same steps as TVM's per-target pipelines (relax/backend/*/pipeline.py), listed here so
    that tvmgraph's own passes have visible places to go.
    """
    # NOTE: relay_passes import tvmgraph, so they are imported here, not at module level.
    from relay_passes.compress_memory import CompressMemory
    from relay_passes.fuse_cast_scale import FuseCastScale
    from relay_passes.fuse_epilogue import FuseEpilogue
    from relay_passes.fuse_model_update import FuseModelUpdate
    from relay_passes.lower_call_tir_with_grad import LowerCallTIRWithGrad
    from relay_passes.simplify_broadcast_matmul import SimplifyBroadcastMatmul
    from relay_passes.simplify_power import SimplifyPower
    from relay_passes.straighten import StraightenBindings

    T = relax.transform
    is_gpu = target.kind.name == "cuda"
    passes = [
        # 1. Sort/scan/sampling ops to library or TIR implementations.
        relax.backend.DispatchSampling(),
        relax.backend.DispatchSortScan(),
        # 2. Training graphs: the optimizer update of each param group becomes one in-place
        #    kernel (allow_fuse_model_update_ops), or its Relax function is inlined.
        FuseModelUpdate(config.fuse_model_update_ops, report),
        T.InlinePrivateFunctions(),
        # 3. Matmuls read broadcast operands in place (MHA's expand + bmm and its gradient);
        #    x ** 2 is x * x (MSELoss and its gradient).
        SimplifyBroadcastMatmul(report),
        SimplifyPower(report),
        #    Each matmul/conv2d is grouped with its epilogue and operand transposes
        #    (allow_fuse_add_to_output); FuseOps (step 5) fuses the rest.
        FuseEpilogue(config.fuse_add_to_output, report),
        #    A cast followed by a scalar multiply is one kernel (allow_fuse_cast_scale).
        FuseCastScale(config.fuse_cast_scale, report),
        # 4. Every Relax op becomes a call to a TIR PrimFunc.
        LowerCallTIRWithGrad(),
        T.LegalizeOps(),
        # 4. Operator fusion: group element-wise/injective ops with their producers.
        #    (No FoldConstant: parameters are inputs, so little folds, and folding compiles and
        #    runs every constant kernel once: 4 s of a 19 s CNN training-graph compile.)
        T.AnnotateTIROpPattern(),
        T.FuseOps(),
        T.FuseTIR(),
        # 5. Schedules for the kernels: dlight on GPU, tvmgraph's CPU rules on LLVM.
        *(_gpu_schedules() if is_gpu else _cpu_schedules(config)),
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
        T.KillAfterLastUse(),
        T.LowerRuntimeBuiltin(),
        T.ComputePrimValue(),
        T.VMShapeLower(),
        T.AttachGlobalSymbol(),
    ]

    @tvm.transform.module_pass(opt_level=0, name="tvmgraph.default_pipeline")
    def pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return pipeline
