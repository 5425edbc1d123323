"""A graph's outputs are freed when the caller drops them, not at the graph's next call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import tvm
from tvm import relax

from tvmgraph.vm_results import RELEASE, releasing, with_release_function

# 64 MiB of output; the naive allocator and glibc's mmap threshold make a freed output leave RSS.
PROBE = textwrap.dedent("""
    import torch, tvmgraph

    def rss_mib():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

    class Double(tvmgraph.nn.Graph):
        def build(self, x):
            return x * 2

    graph, x = Double(), torch.ones(4096, 4096)
    graph(x)
    out = graph(x)
    held = rss_mib()
    del out
    print(held - rss_mib())
""")


def test_outputs_are_freed_when_the_caller_drops_them(tmp_path) -> None:
    env = dict(os.environ, TVMGRAPH_VM_ALLOCATOR="naive", MALLOC_MMAP_THRESHOLD_="65536",
               TVMGRAPH_CACHE_DIR=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                            timeout=300, check=True)
    freed = float(result.stdout.strip().splitlines()[-1])
    assert freed > 60, f"dropping the 64 MiB output freed {freed:.1f} MiB (the VM kept its last result)"


def _identity_module() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        bb.emit_func_output(x)
    return bb.get()


def test_release_function_is_added_once_and_returns_nothing() -> None:
    mod = with_release_function(with_release_function(_identity_module()))
    assert [gv.name_hint for gv in mod.get_global_vars()].count(RELEASE) == 1
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    assert len(vm[RELEASE]()) == 0
    x = tvm.runtime.tensor(np.arange(4, dtype="float32"))
    np.testing.assert_array_equal(releasing(vm, "main")(x).numpy(), np.arange(4))


def test_a_program_without_it_runs_its_functions_as_they_are() -> None:
    """A graph saved before RELEASE existed still runs."""
    vm = relax.VirtualMachine(tvm.compile(_identity_module(), target="llvm"), tvm.cpu())
    x = tvm.runtime.tensor(np.arange(4, dtype="float32"))
    np.testing.assert_array_equal(releasing(vm, "main")(x).numpy(), np.arange(4))
