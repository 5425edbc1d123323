"""Lowering: a traced `torch.export` program becomes a Relax `IRModule`.

Steps, in order:
  1. decompose to core ATen (`ExportedProgram.run_decompositions`);
  2. check every op against the importer's table, naming the module and the source line each
     unsupported op came from (all of them at once, not the first only);
  3. turn every input into a plain function parameter and every output into a plain result.
     TVM's importer would otherwise bind buffers and lifted constants into the module as copies
     (stale as soon as the eager module changes them) and would drop buffer mutations such as
     batch-norm running statistics. Inputs keep this order: user inputs, parameters, buffers,
     constants; `LoweredSignature` records where each one comes from and which outputs are
     mutations to write back. A parameter reached by several paths (weight tying, one module
     registered twice) is one input, named by its first path: torch.export lifts it once per
     path, and as separate inputs its gradient would be split between them;
  4. import with `from_exported_program`, using tvmgraph's own converters where the stock ones
     are wrong for training (see converters.py), and note on each node the Relax variable that
     holds its result, so that a later check can name the node a Relax binding came from
     (`relax_origins`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._decomp
import tvm
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from tvm import relax, te
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from . import (added_decompositions, converters, converters_cholesky, converters_linalg, decompositions,
               empty_results, half_in_float32, random_ops, result_shapes, scans_in_float64, type_promotion,
               zero_dim)
from .errors import TraceError, UnsupportedOpError
from .trace import global_hooks_on_user_modules, math_attention

_INPUT_ORDER = {InputKind.USER_INPUT: 0, InputKind.PARAMETER: 1, InputKind.BUFFER: 2,
                InputKind.CONSTANT_TENSOR: 3}


@dataclass(frozen=True)
class InputSource:
    """Where the runtime finds one parameter of `main`: a user input, or a tensor by path."""

    kind: str  # "user" | "parameter" | "buffer" | "constant" | "rng"
    target: str | None  # module path for parameter/buffer, constant name, None for user inputs


@dataclass(frozen=True)
class LoweredSignature:
    """How `main`'s parameters and results map onto the torch side.

    Results are laid out as: mutations (written back in place), then user outputs, then the
    loss when `build()` called backward().
    """

    inputs: tuple[InputSource, ...]
    mutations: tuple[InputSource, ...]
    num_user_outputs: int
    has_loss: bool
    constants: dict[str, torch.Tensor]
    input_types: tuple[tuple[tuple[int, ...], str], ...] = ()  # (shape, dtype) of each input
    # (user output, input) pairs: build() returned that input itself (`return x`, a parameter),
    # which eager hands back as the same tensor object (stages.returned_tensors).
    returned_inputs: tuple[tuple[int, int], ...] = ()


# Ops that torch.export keeps whole but that torch's own decompositions rewrite into ops with a
# lowering (and a gradient): copies of views, a matrix-vector product, a distance, any(x).
_aten = torch.ops.aten
EXTRA_DECOMPOSITIONS = [
    _aten.any.default, _aten.addmv.default, _aten.dist.default, _aten.narrow_copy.default,
    _aten.view_copy.default, _aten.permute_copy.default, _aten.unbind_copy.int,
]


def decompose(exported: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Rewrite the program into core ATen ops, the vocabulary the Relax importer knows."""
    with warnings.catch_warnings():
        # torch 2.13 deep-copies its own pytree specs here and warns about itself.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        table = torch.export.default_decompositions()
        # Kept whole: its decomposition has a NaN gradient on fully masked rows (converters_nn.py).
        table.pop(torch.ops.aten._safe_softmax.default)
        table.update(torch._decomp.get_decompositions(EXTRA_DECOMPOSITIONS))
        # Kept whole: their decompositions index with broadcast index tensors (converters_nn.py).
        nearest = [getattr(torch.ops.aten, f"{name}{rank}d").vec for name in ("upsample_nearest", "_upsample_nearest_exact")
                   for rank in (1, 2, 3)]
        for op in (torch.ops.aten.im2col.default, torch.ops.aten.upsample_linear1d.vec,
                   torch.ops.aten.upsample_trilinear3d.vec, *nearest):
            table.pop(op, None)
        # Not in the export table; decomposes to a scatter_add of the gradient at the indices.
        pool_backward = torch.ops.aten.max_pool2d_with_indices_backward.default
        if pool_backward in torch._decomp.decomposition_table:  # torch < 2.12 has none
            table[pool_backward] = torch._decomp.decomposition_table[pool_backward]
        # Kept whole: their decompositions mix dtypes (heaviside) or have NaN gradients from the
        # branch `where` drops (log_ndtr); converters_special.py lowers them.
        table.pop(torch.ops.aten.heaviside.default)
        table.pop(torch.ops.aten.special_log_ndtr.default)
        # Kept whole: their decompositions clamp, whose gradient passes at the edges where
        # theirs stops (x = +-3); the stock converters' `clip` stops there too.
        table.pop(torch.ops.aten.hardsigmoid.default)
        table.pop(torch.ops.aten.hardswish.default)
        # Kept whole: their decompositions differentiate the `where` branch they drop, NaN for
        # a large input (converters_activation.py).
        table.pop(torch.ops.aten.softplus.default)
        table.pop(torch.ops.aten.mish.default)
        table.pop(torch.ops.aten.celu.default, None)  # `where(x > 0, x, expm1(x))`: lowered as an elu
        # Kept whole: their decompositions' dropped branch has a NaN gradient at x = 0 (converters_xlogy.py).
        for xlog in (_aten.xlogy.Tensor, _aten.xlogy.Scalar_Self, _aten.xlogy.Scalar_Other,
                     _aten.special_xlog1py.default, _aten.special_xlog1py.self_scalar,
                     _aten.special_xlog1py.other_scalar):
            table.pop(xlog, None)
        # Kept whole: its decomposition guards on the index's value when the index is 0-d
        # (torch.export refused `torch.take(x, torch.tensor(3))`); converters.py lowers it.
        table.pop(torch.ops.aten.take.default, None)
        # Kept whole: their decompositions compute in the result dtype (a bfloat16 linspace a
        # step off eager's); converters.py makes eager's tensor of constant bounds.
        table.pop(torch.ops.aten.linspace.default, None)
        table.pop(torch.ops.aten.logspace.default, None)
        table.update(decompositions.FIXED)  # torch's own give other numbers than eager
        table.update(added_decompositions.ADDED)  # ops nothing else lowers
        devices = [n.meta["val"].device for n in exported.graph.nodes
                   if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
        with math_attention(devices), global_hooks_on_user_modules():
            try:
                decomposed = exported.run_decompositions(table)
            except Exception as error:
                if "Cannot view a tensor" not in str(error) or not _views_as_reshapes(exported):
                    raise
                decomposed = exported.run_decompositions(table)
    _drop_runtime_asserts(decomposed)
    _drop_linalg_checks(decomposed)
    return decomposed


def _views_as_reshapes(exported: torch.export.ExportedProgram) -> bool:
    """Turn every `aten.view` of `exported` into `aten.reshape`; False when it has none.

    Traced below autocast (AMP), a reshape after a fused kernel is recorded as a view, valid
    for the strides of that kernel's result; the kernel's decomposition can leave other strides
    (CPU flash attention's output, then `transpose(1, 2).reshape(B, T, D)`), and the view then
    fails to decompose. The program is functional (nothing writes through a view), so a
    reshape, a copy where the strides need one, computes the same values."""
    graph = exported.graph_module.graph
    views = [n for n in graph.nodes if n.op == "call_function" and n.target is _aten.view.default]
    for node in views:
        node.target = _aten.reshape.default
    if views:
        exported.graph_module.recompile()
    return bool(views)


def _drop_linalg_checks(exported: torch.export.ExportedProgram) -> None:
    """Remove `_linalg_check_errors` (torch.linalg.inv and solve raise with it on a singular
    matrix), which export threads through effect tokens (`with_effects`). The compiled program
    cannot raise on a computed value: a singular matrix gives inf/NaN (converters_linalg.py)."""
    if not any(n.op == "call_function" and n.target is torch.ops.higher_order.with_effects
               for n in exported.graph.nodes):
        return
    from torch.export._remove_effect_tokens_pass import _remove_effect_tokens

    _remove_effect_tokens(exported)
    graph = exported.graph_module.graph
    checks = [n for n in graph.nodes if n.op == "call_function" and n.target is _aten._linalg_check_errors.default]
    for node in checks:
        graph.erase_node(node)
    graph.eliminate_dead_code()
    exported.graph_module.recompile()


def _drop_runtime_asserts(exported: torch.export.ExportedProgram) -> None:
    """Remove `_assert_async` (one_hot's decomposition checks its classes with it) and what
    only fed it. The importer makes a program holding one impure, with no dataflow block:
    Relax autodiff then refuses it and FuseOps fuses nothing. The check is kept on the torch
    side: IndexGuard tests one_hot's classes before each call when they come from an input;
    a class computed in the graph out of range gives a row of zeros (eager raises).

    Also removes export's checks of a data-dependent size (`_assert_scalar(u0 >= 0)`,
    `sym_constrain_range_for_size`), which the importer reads as no-ops: they were the only
    readers of an unused `torch.where(mask)` / `nonzero`, which then stayed in the program and
    made a training graph refuse to differentiate a shape it never used."""
    graph = exported.graph_module.graph
    asserts = [n for n in graph.nodes if n.op == "call_function" and n.target in _NO_OP_CHECKS]
    for node in asserts:
        graph.erase_node(node)
    if asserts:
        graph.eliminate_dead_code()
        exported.graph_module.recompile()


_NO_OP_CHECKS = (_aten._assert_async.default, _aten._assert_async.msg, _aten._assert_scalar.default,
                 _aten.sym_constrain_range_for_size.default)


def op_key(node: torch.fx.Node) -> str:
    """The name the importer uses for a node's op: `convolution.default`, `getitem`, ..."""
    return node.target.__name__


def module_path(node: torch.fx.Node) -> str:
    """`model.features.3 (InvertedResidual)` for the innermost module a node came from."""
    frames = [v for v in (node.meta.get("nn_module_stack") or {}).values() if v[0]]
    if not frames:  # only the root module: the op is written in build() itself
        return "build() itself"
    path, cls = frames[-1]
    return f"'{path}' ({cls.rsplit('.', 1)[-1] if isinstance(cls, str) else cls.__name__})"


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, converters))
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in ')


def source_line(node: torch.fx.Node) -> str | None:
    """`model.py:12: return torch.linalg.qr(x).Q`: the innermost frame of the node's
    recorded stack trace that is the user's code (not torch's or tvmgraph's), None if none is.

    torch.export records the frames of `forward()` methods, and of `build()` (trace.py
    registers it), so an op in a helper function gets the line that called the helper.
    """
    found = None
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i, line in enumerate(lines):
        match = _FRAME.match(line.strip())
        if match and not match["file"].startswith(_LIBRARY_DIRS):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1].strip()) else ""
            found = f"{_short_path(match['file'])}:{match['line']}" + (f": {code}" if code else "")
    return found


def _short_path(file: str) -> str:
    """Relative to the working directory when the file lies under it."""
    relative = os.path.relpath(file) if os.path.isabs(file) else file
    return file if relative.startswith("..") else relative


def describe(node: torch.fx.Node) -> str:
    """`aten.linalg_qr.default from 'head' (Orthonormal) at model.py:12: return ...`"""
    where = source_line(node)
    return f"aten.{op_key(node)} from {module_path(node)}" + (f" at {where}" if where else "")


# In-place ops on a detached view of a parameter that torch.export keeps but functionalization
# then drops: the graph would run without them, silently. {op: (what, fix)}
_DROPPED_MUTATIONS = {
    "embedding_renorm_.default": (
        "nn.Embedding(max_norm=...) renormalizes the rows it reads in its weight, in place, on "
        "every forward call; tvmgraph does not run that mutation (the rows would keep their norm)",
        "drop max_norm, or renormalize the weight outside the graph before each call "
        "(with torch.no_grad(): torch.embedding_renorm_(emb.weight, ids, max_norm, 2.0))"),
}


def check_no_dropped_mutations(exported: torch.export.ExportedProgram, graph_name: str) -> None:
    """Raise UnsupportedOpError for an in-place op that decomposition would drop (before it)."""
    for node in exported.graph.nodes:
        if node.op == "call_function" and op_key(node) in _DROPPED_MUTATIONS:
            what, fix = _DROPPED_MUTATIONS[op_key(node)]
            raise UnsupportedOpError(f"{graph_name}: {describe(node)}: {what}. Fix: {fix}.")


def check_no_parameter_mutations(exported: torch.export.ExportedProgram, graph_name: str) -> None:
    """Raise UnsupportedOpError when build() writes a parameter in place (weight clipping,
    `p.clamp_()` under no_grad): a graph updates parameters only in its optimizer step."""
    kind = torch.export.graph_signature.OutputKind.PARAMETER_MUTATION
    mutated = [spec.target for spec in exported.graph_signature.output_specs if spec.kind == kind]
    if mutated:
        raise UnsupportedOpError(
            f"{graph_name}: build() changes parameter(s) {', '.join(mutated)} in place (an in-place op "
            f"on a parameter, e.g. weight clipping under torch.no_grad()); a graph changes parameters "
            f"only through its optimizer. Fix: do it outside the graph, after the call (with "
            f"torch.no_grad(): p.clamp_(...)), or compute a clipped copy in build() "
            f"(w = p.clamp(...)) and use that.")


def check_supported(exported: torch.export.ExportedProgram, graph_name: str) -> None:
    """Raise UnsupportedOpError listing every op the importer cannot lower, each with its module
    and source line."""
    known = set(ExportedProgramImporter().convert_map) | set(converters.CONVERTERS) | random_ops.OPS
    missing = [node for node in exported.graph.nodes if node.op == "call_function" and op_key(node) not in known]
    complex_values = [node for node in exported.graph.nodes if _is_complex(node)]
    if complex_values:
        node = complex_values[0]
        what = (f"input '{node.name}'" if node.op == "placeholder" else describe(node))
        raise UnsupportedOpError(
            f"{graph_name}: {what} is a {str(node.meta['val'].dtype).removeprefix('torch.')} tensor; TVM has "
            f"no complex dtypes. Keep complex values outside the graph: pass torch.view_as_real(z) (real and "
            f"imaginary parts as a last dim of 2) and compute with the parts.")
    float8 = next((node for node in exported.graph.nodes if _dtypes(node) & _FLOAT8), None)
    if float8 is not None:  # the importer raised NotImplementedError, reported as a tvmgraph bug
        what = (f"input '{float8.name}'" if float8.op == "placeholder" else describe(float8))
        dtype = sorted(_dtypes(float8) & _FLOAT8, key=str)[0]
        raise UnsupportedOpError(
            f"{graph_name}: {what} is a {str(dtype).removeprefix('torch.')} tensor; TVM 0.27's PyTorch importer has "
            f"no float8 dtypes. Keep float8 casts outside the graph, or emulate the rounding in float32.")
    cond = getattr(torch.ops.higher_order, "cond", None)
    branching = [node for node in exported.graph.nodes if node.op == "call_function" and node.target is cond]
    if branching:  # TVM translates the branches with its own converters only (a CompileError)
        raise UnsupportedOpError(
            f"{graph_name}: {describe(branching[0])}: torch.cond on a tensor predicate has no lowering yet; "
            f"compute both branches and pick one with torch.where(pred, a, b)")
    if missing:
        lines = dict.fromkeys(f"  * {describe(node)}" for node in missing)  # one per op and place
        raise UnsupportedOpError(
            f"{graph_name}: {len({op_key(n) for n in missing})} op(s) used in build() have no lowering "
            f"to TVM Relax:\n"
            + "\n".join(lines)
            + "\nRewrite that code with supported torch ops, or run the module eagerly outside "
            "the graph. Supported ops are listed by `tvmgraph.lower.supported_ops()`."
        )


_FLOAT8 = {getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                             "float8_e8m0fnu") if hasattr(torch, name)}


def _dtypes(node: torch.fx.Node) -> set[torch.dtype]:
    values = node.meta.get("val")
    return {v.dtype for v in (values if isinstance(values, (list, tuple)) else [values]) if isinstance(v, torch.Tensor)}


def _is_complex(node: torch.fx.Node) -> bool:
    values = node.meta.get("val")
    return any(isinstance(v, torch.Tensor) and v.is_complex()
               for v in (values if isinstance(values, (list, tuple)) else [values]))


# Ops whose float operands eager torch requires to share one dtype (its kernels raise "mat1 and
# mat2 must have the same dtype"); torch.export's meta kernels do not check, and TVM then failed
# with an internal type error.
_SAME_DTYPE_OPS = {"mm.default", "addmm.default", "bmm.default", "baddbmm.default", "addmv.default",
                   "mv.default", "dot.default", "convolution.default"}


def check_dtypes(exported: torch.export.ExportedProgram, graph_name: str) -> None:
    """Raise TraceError for a matmul or convolution of tensors of different dtypes (a float64
    module fed float32 inputs, integer inputs to a float layer), as eager torch would raise.
    torch's meta kernels let some through (addmm of int64 and float32: a CompileError after)."""
    for node in exported.graph.nodes:
        if node.op != "call_function" or op_key(node) not in _SAME_DTYPE_OPS:
            continue
        dtypes = {a.meta["val"].dtype for a in node.args
                  if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)}
        if len(dtypes) > 1:
            names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise TraceError(
                f"{graph_name}: {describe(node)} takes {names} tensors; eager torch raises here "
                f"(\"must have the same dtype\"). Give the module and its inputs one dtype: "
                f"module.float(), x.float() or x.double(), or enable_amp(True) for mixed precision.")


def supported_ops() -> list[str]:
    """Core ATen ops (after decomposition) that tvmgraph can lower."""
    return sorted(set(ExportedProgramImporter().convert_map) | set(converters.CONVERTERS) | random_ops.OPS)


RNG_INPUT = "rng_seed"


def _add_rng_input(exported: torch.export.ExportedProgram) -> tuple[torch.fx.Node | None, dict[torch.fx.Node, int]]:
    """Give the program an int64[2] seed input if it draws random numbers (train-mode dropout,
    `torch.rand`, ...: counter_rng.py); number the random ops (their salts)."""
    graph = exported.graph
    randoms = [n for n in graph.nodes if random_ops.draws_random_numbers(n)]
    if not randoms:
        return None, {}
    last_placeholder = list(graph.find_nodes(op="placeholder"))[-1]
    with graph.inserting_after(last_placeholder):
        seed = graph.placeholder(RNG_INPUT)
    seed.meta["val"] = torch.zeros(2, dtype=torch.int64)
    return seed, {node: salt for salt, node in enumerate(randoms)}


def _merge_tied_parameters(exported: torch.export.ExportedProgram) -> set[str]:
    """Make every use of a parameter lifted under several paths read its first path's input.

    Returns the placeholder names dropped. The first path is the one `named_parameters()`
    reports (both walk the modules in the same order), so the training plan finds it.
    """
    placeholders = {n.name: n for n in exported.graph.find_nodes(op="placeholder")}
    first: dict[int, torch.fx.Node] = {}
    dropped = set()
    for spec in exported.graph_signature.input_specs:
        if spec.kind != InputKind.PARAMETER or spec.target not in exported.state_dict:
            continue
        node = placeholders[spec.arg.name]
        key = id(exported.state_dict[spec.target])
        if key not in first:
            first[key] = node
            continue
        node.replace_all_uses_with(first[key])
        exported.graph.erase_node(node)
        dropped.add(spec.arg.name)
    return dropped


def _plain_signature(exported: torch.export.ExportedProgram, seed: torch.fx.Node | None,
                     dropped: set[str] = frozenset()) -> tuple[ExportGraphSignature, LoweredSignature]:
    """Every input becomes a user input (user inputs first, then the rng seed if any), every
    output a user output; inputs named in `dropped` are left out."""
    kind_names = {InputKind.USER_INPUT: "user", InputKind.PARAMETER: "parameter",
                  InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant"}
    specs = sorted((s for s in exported.graph_signature.input_specs if s.arg.name not in dropped),
                   key=lambda s: _INPUT_ORDER[s.kind])
    sources, inputs = [], []
    for spec in specs:
        if spec.kind not in kind_names:
            raise NotImplementedError(f"torch.export input kind {spec.kind} is not supported")
        if seed is not None and spec.kind != InputKind.USER_INPUT and not any(s.kind == "rng" for s in sources):
            sources.append(InputSource("rng", None))
            inputs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(seed.name), None, None))
        sources.append(InputSource(kind_names[spec.kind], spec.target))
        inputs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(spec.arg.name), None, None))
    if seed is not None and not any(s.kind == "rng" for s in sources):
        sources.append(InputSource("rng", None))
        inputs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(seed.name), None, None))

    mutations, outputs, num_user = [], [], 0
    for spec in exported.graph_signature.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutations.append(InputSource("buffer", spec.target))
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            user_names = [s.arg.name for s in specs if s.kind == InputKind.USER_INPUT]
            mutations.append(InputSource("user", str(user_names.index(spec.target))))
        elif spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
            num_user += 1
        else:
            raise NotImplementedError(f"torch.export output kind {spec.kind} is not supported")
        outputs.append(OutputSpec(OutputKind.USER_OUTPUT, spec.arg, None))
    return (
        ExportGraphSignature(input_specs=inputs, output_specs=outputs),
        LoweredSignature(tuple(sources), tuple(mutations), num_user, has_loss=False,
                         constants=dict(exported.constants)),
    )


def to_relax(exported: torch.export.ExportedProgram, graph_name: str, has_loss: bool) -> tuple[tvm.IRModule, LoweredSignature]:
    """Import a decomposed, checked program into Relax with plain inputs and outputs.

    NOTE: `exported` is modified (its signature and constants); pass a program of your own,
    such as the result of `decompose`.
    """
    seed, salts = _add_rng_input(exported)
    dropped = _merge_tied_parameters(exported)
    plain_sig, lowered_sig = _plain_signature(exported, seed, dropped)
    exported._graph_signature = plain_sig
    exported._constants = {}  # constants are inputs now; nothing is bound into the module
    convert_map = dict(converters.CONVERTERS, **random_ops.converters(seed, salts),
                       **{"native_dropout.default": converters.dropout(seed, salts)},
                       **converters_linalg.converters(differentiated=has_loss),
                       **converters_cholesky.converters(differentiated=has_loss))
    convert_map.update(_returned_copies())
    convert_map = scans_in_float64.with_float64_scans(convert_map)
    convert_map = zero_dim.with_zero_dim(type_promotion.with_promotion(half_in_float32.with_float32(convert_map)))
    convert_map = {key: _named_errors(fn, graph_name) for key, fn in convert_map.items()}
    convert_map = empty_results.with_empty_results(convert_map)
    convert_map = result_shapes.with_checked_results(convert_map, graph_name, describe)
    importer = ExportedProgramImporter()
    mod = importer.from_exported_program(exported, keep_params_as_input=False, unwrap_unit_return_tuple=False,
                                         no_bind_return_tuple=True, custom_convert_map=convert_map)
    _note_relax_vars(importer)
    num_user = lowered_sig.num_user_outputs - (1 if has_loss else 0)
    types = tuple((_static_dims(p.ty.shape), p.ty.dtype.dtype) for p in mod["main"].params)
    lowered_sig = dataclasses.replace(lowered_sig, num_user_outputs=num_user, has_loss=has_loss,
                                      input_types=types, returned_inputs=_returned_inputs(exported, mod, lowered_sig))
    return mod, lowered_sig


_ALIASES = (_aten.alias.default, _aten.detach.default, torch.ops.tvmgraph.stop_gradient.default)


def _returned_copies() -> dict[str, Callable]:
    """`clone`, `lift_fresh_copy` and `_to_copy` (its dtype unchanged) of a program input that
    build() returns: a copy kernel. The importer makes them the input's own variable, and the VM
    returned the input's memory: `return self.weight.clone()` came back as the weight (writing
    into it changed the model; a training step's in-place update showed in it)."""
    def copying(stock: Callable) -> Callable:
        def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
            value = stock(importer, node)
            source = root = node.args[0]
            while isinstance(root, torch.fx.Node) and root.target in _ALIASES:  # x.detach().clone()
                root = root.args[0]
            if (isinstance(root, torch.fx.Node) and root.op == "placeholder" and value.same_as(importer.env[source])
                    and any(user.op == "output" for user in node.users)):
                return importer.block_builder.emit_te(lambda t: te.compute(t.shape, lambda *i: t(*i), name="copy"),
                                                      value, primfunc_name_hint="copy")
            return value
        return convert

    identity = lambda importer, node: importer.env[node.args[0]]  # noqa: E731  (the importer's clone)
    to_copy = lambda importer, node: importer._to_copy(node)  # noqa: E731
    return {"clone.default": copying(identity), "lift_fresh_copy.default": copying(to_copy),
            "_to_copy.default": copying(to_copy)}


def _returned_inputs(exported: torch.export.ExportedProgram, mod: tvm.IRModule,
                     sig: LoweredSignature) -> tuple[tuple[int, int], ...]:
    """(user output, main parameter) for each output that is a placeholder of the program."""
    params = [p.name for p in mod["main"].params]
    (results,) = [n.args[0] for n in exported.graph.nodes if n.op == "output"]
    user = list(results)[len(sig.mutations):len(sig.mutations) + sig.num_user_outputs]
    return tuple((i, params.index(node.name)) for i, node in enumerate(user)
                 if isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.name in params)


def _static_dims(shape: relax.ShapeExpr) -> tuple[int, ...]:
    """A shape as ints; a symbolic dim (a dynamic batch) is -1."""
    return tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else -1 for d in shape)


RELAX_VAR = "tvmgraph_relax_var"


def _note_relax_vars(importer: ExportedProgramImporter) -> None:
    """Note on each node the name of the Relax variable(s) holding its result. A node whose
    converter returned another node's variable (`clone`, `alias`) gets nothing: the variable
    is the other node's."""
    owned = set()
    for node, value in importer.env.items():
        fields = value.fields if isinstance(value, relax.Tuple) else [value]
        names = [v.name for v in fields if isinstance(v, relax.Var) and v.name not in owned]
        if names and node.op == "call_function":
            node.meta[RELAX_VAR] = names
        owned.update(v.name for v in fields if isinstance(v, relax.Var))


def relax_origins(exported: torch.export.ExportedProgram) -> dict[str, str]:
    """Relax variable name -> `describe(node)` of the node whose converter made it (after
    `to_relax`). Bindings a converter made on the way to its result are not in it."""
    return {name: describe(node) for node in exported.graph.nodes for name in node.meta.get(RELAX_VAR, ())}


def _named_errors(fn: Callable, graph_name: str) -> Callable:
    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        try:
            return fn(node, importer)
        except NotImplementedError as e:
            raise UnsupportedOpError(
                f"{graph_name}: aten.{op_key(node)} from {module_path(node)} cannot be lowered: {e}"
            ) from None

    return convert
