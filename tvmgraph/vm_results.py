"""The Relax VM keeps the value its last call returned until its next call.

TVM 0.27's VM holds a function's return value (every output of a graph call) after the call
returns, until the next call of any function of the VM replaces it. A caller that drops a
graph's outputs before the next call (a serving loop, `benchmarks.memory`) still had them
allocated during that call: a GPT's 16 MiB of logits counted twice at the inference peak.

So every program carries RELEASE, a function of no arguments that returns an empty tuple, and
callers take a program's functions through `releasing`, which runs RELEASE after each call,
once the outputs are in Python's hands (0.3 us). A saved graph from before it existed has no
RELEASE: its functions are called as they are.

`releasing` also hands the results back as a list. Indexing tvm-ffi's Array goes through
Python helpers and asks for its length each time: after kernels that streamed more than L2
holds, taking the one output of the batch-1 MLP cost 13 us that way and 7.5 us through
`ffi.ArrayGetItem` alone (2-vCPU Xeon, cold caches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RELEASE = "tvmgraph_release"


def with_release_function(mod: Any) -> Any:
    """`mod` (a Relax IRModule ready for code generation) with RELEASE added."""
    import tvm
    from tvm import relax

    if any(gv.name_hint == RELEASE for gv in mod.get_global_vars()):
        return mod
    release = relax.Function([], relax.Tuple([]), relax.TupleType([]))
    copy = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs, global_infos=mod.global_infos)
    copy[RELEASE] = release.with_attr("global_symbol", RELEASE)
    return copy


def releasing(vm: Any, name: str) -> Callable[..., Any]:
    """`vm[name]`, followed on every call by the VM's RELEASE (if the program has one); a
    tuple result comes back as a list."""
    import tvm_ffi

    function = vm[name]
    try:
        release = vm[RELEASE]
    except AttributeError:  # TVM's answer for a function the program does not have
        release = None
    array, size, get = tvm_ffi.Array, tvm_ffi.get_global_func("ffi.ArraySize"), tvm_ffi.get_global_func("ffi.ArrayGetItem")

    def call(*args: Any) -> Any:
        result = function(*args)
        if release is not None:
            release()
        if type(result) is array:
            return [get(result, i) for i in range(size(result))]
        return result

    return call
