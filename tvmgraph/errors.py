"""Exceptions a user of tvmgraph can act on.

One class per mistake. Every message names the graph, the argument or op at fault, and the fix;
`str(err)` ends with a link to the section of docs/errors.md that explains the class.
Each class also derives from the built-in exception a Python user would expect (`TypeError` for
a wrong argument, `NotImplementedError` for a missing feature), so existing `except` clauses work.
"""

from __future__ import annotations

DOCS = "docs/errors.md"


def reason_of(e: BaseException, lines: int = 1) -> str:
    """The last `lines` non-blank lines of an error's message: TVM's errors put the traceback
    first and the reason last (a tvmgraph error raised inside a pass: before its docs link)."""
    found = [line.strip() for line in str(e).splitlines()
             if line.strip() and not line.startswith(f"See {DOCS}#")]
    return " / ".join(found[-lines:])[:400] if found else type(e).__name__


class TvmGraphError(Exception):
    """Base class of every error tvmgraph raises on purpose."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nSee {DOCS}#{type(self).__name__.lower()}"


class GraphInitError(TvmGraphError, RuntimeError):
    """`super().__init__()` was not called at the start of a Graph subclass's `__init__`."""


class NestedGraphError(TvmGraphError, TypeError):
    """A Graph was assigned to, or called inside, another Graph (not supported, as in OneFlow)."""


class GraphAttributeError(TvmGraphError, TypeError):
    """A value the graph cannot own was assigned as a graph attribute (a bare tensor, say)."""


class BuildNotImplementedError(TvmGraphError, NotImplementedError):
    """The Graph subclass does not override `build()`."""


class GraphArgumentError(TvmGraphError, TypeError):
    """The arguments of a graph call do not fit `build()`: count, keywords or types."""


class GraphOutputError(TvmGraphError, TypeError):
    """`build()` returned something other than Tensors, lists/tuples of Tensors, or None."""


class DeviceMismatchError(TvmGraphError, RuntimeError):
    """Inputs, parameters and buffers of one graph call live on different devices."""


class StaleGraphError(TvmGraphError, RuntimeError):
    """A tensor no longer fits the compiled program, and looking at the model again found no
    change to compile for (a tvmgraph bug)."""


class TraceError(TvmGraphError, RuntimeError):
    """`torch.export` could not trace `build()`; the message carries torch's reason."""


class UnsupportedOpError(TvmGraphError, NotImplementedError):
    """`build()` uses an op that has no lowering to Relax."""


class BackwardError(TvmGraphError, RuntimeError):
    """`loss.backward()` was misused inside `build()` (non-scalar loss, no optimizer, twice...)."""


class OptimizerError(TvmGraphError, TypeError):
    """An optimizer, its options or its lr scheduler cannot be lowered into the graph."""


class ConfigError(TvmGraphError, ValueError):
    """A `GraphConfig` option or a `TVMGRAPH_*` environment variable got a value it does not take."""


class UnsupportedOptionError(TvmGraphError, NotImplementedError):
    """A documented option (OneFlow's) that tvmgraph does not implement yet was switched on."""


class MicroBatchError(TvmGraphError, ValueError):
    """Gradient accumulation cannot split a call's batch into equal micro-batches."""


class DistributedError(TvmGraphError, RuntimeError):
    """Data-parallel training failed across ranks: a collective failed (a rank stopped, a timeout),
    the ranks ran different programs, or a distributed option has no process group to run in."""


class PipelineError(TvmGraphError, ValueError):
    """build() cannot be cut into the pipeline stages given with `GraphModule.set_stage`: the
    stages do not follow the computation, a weight is shared by two stages, a stage runs no op."""


class RecompileLimitError(TvmGraphError, RuntimeError):
    """A graph was asked to compile more entries than `GraphConfig.set_recompile_limit` allows."""


class CompileError(TvmGraphError, RuntimeError):
    """Lowering or compiling a traced graph failed inside TVM (a tvmgraph bug: please report it)."""


class ExecutionError(TvmGraphError, RuntimeError):
    """The compiled program failed while running (the message carries the runtime's reason)."""


class StateDictError(TvmGraphError, ValueError):
    """`Graph.load_state_dict` was given a state dict that does not fit the graph."""


class UnsupportedDeviceError(TvmGraphError, NotImplementedError):
    """The inputs or modules are on a device tvmgraph does not compile for (it does CPU and CUDA)."""


class PassError(TvmGraphError, RuntimeError):
    """A compiler pass the compile cannot do without failed (raised, or left an ill-formed module)."""


class IndexOutOfRangeError(TvmGraphError, IndexError):
    """An index input (token ids, labels, gather/scatter indices) holds a value out of range."""


class GraphPickleError(TvmGraphError, TypeError):
    """A graph was pickled (`pickle.dumps`, `torch.save`): use `tvmgraph.save(graph, path)`."""


class SaveError(TvmGraphError, ValueError):
    """`tvmgraph.save` cannot save this graph as asked (never called, unknown target, no linker)."""


class TuningError(TvmGraphError, RuntimeError):
    """`tvmgraph.tune` cannot tune this graph: never called and no inputs given, or nothing to
    tune in its program."""


class SavedGraphError(TvmGraphError, ValueError):
    """`tvmgraph.load` refused a saved graph: a file is missing or changed, or the graph was
    built for another format, platform or TVM version."""


class SavedGraphInputError(TvmGraphError, ValueError):
    """A loaded graph was called with inputs that do not match its manifest (count, type,
    dtype, shape or device)."""
