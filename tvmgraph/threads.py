"""How many threads TVM's CPU kernels run on, set before TVM's thread pool starts.

Graph programs run their kernels on torch's OpenMP threads instead (tvmgraph/openmp_launch.py);
TVM's pool serves where that launcher is not used (a process without torch, a program run from
memory).

TVM reads TVM_NUM_THREADS and TVM_THREAD_POOL_SPIN_COUNT once, when its thread pool starts (the
first parallel kernel). `import tvmgraph` sets both, unless the user exported them, so that
every way into TVM gets them: a graph, a saved graph loaded without torch (`tvmgraph.load`), a
kernel built by the benchmarks or the tuner.

* Without TVM_NUM_THREADS, TVM on x86 runs half as many threads as there are logical CPUs (it
  assumes hyper-threading) and pins the calling thread to one core: on the 2-core Zen 5 test
  machine every kernel ran on one thread (GEMV 48 us instead of 23 us; a saved graph loaded in a
  serving process, and benchmarks.kernels, ran that way), and the Python main thread, torch's
  included, stayed pinned to CPU 0 afterwards. Kernels use torch's intra-op thread count when
  torch is loaded (its own pick of cores, physical ones on hyper-threaded CPUs), else one
  thread per physical core this process may run on.
* TVM's worker threads spin after each parallel kernel before they sleep. With the default
  spin count they keep both cores busy long after a graph call returns, and eager torch code
  that runs next (its OpenMP threads) slows down up to 40x (measured: a 70 us eager MLP took
  2.5 ms right after a graph call). A short spin keeps consecutive kernels of one graph call on
  warm threads and lets them sleep between calls.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SPIN_COUNT = 1000


def physical_cores(sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads counted once);
    the number of those CPUs where the kernel does not say which core each is."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def kernel_threads() -> int:
    """torch's intra-op thread count when torch is loaded, else the physical cores."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return max(1, torch.get_num_threads())
    return physical_cores()


def configure() -> None:
    """Set TVM's thread count and spin count for this process, unless the user has."""
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(SPIN_COUNT))
    os.environ.setdefault("TVM_NUM_THREADS", str(kernel_threads()))
