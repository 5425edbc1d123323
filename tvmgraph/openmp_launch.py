"""TVM's CPU kernels run on torch's OpenMP threads instead of a thread pool of their own.

A compiled library calls its runtime's parallel launcher through a pointer it exports,
`__TVMBackendParallelLaunch` (and `__TVMBackendParallelBarrier`), which TVM fills with its own
thread pool's when it loads the library. In a process where torch runs too, that makes two pools
of spinning threads on the same cores: after any eager op torch's OpenMP workers spin for a few
milliseconds waiting for more work, and a graph call that comes then splits each kernel over
TVM's threads, one of which shares a core with a spinning OpenMP worker and gets a time slice
late. Measured on 2 vCPUs (AMD Zen 4), the batch-64 MLP with a 13 us eager preprocessing step
before each call: inference 9.4 ms instead of 1.65, the training step 12.4 ms instead of 4.5.

`load_library(path)` loads a compiled library as `tvm.runtime.load_module` does, then
(`use_openmp_threads`) points those two pointers at a small launcher (SOURCE) that runs the kernel's tasks as one OpenMP parallel region on the OpenMP
runtime torch already loaded: one pool for eager and compiled code, as wide as
`torch.get_num_threads()`, warm after either. Without a loaded OpenMP runtime (a process
without torch, `tvmgraph.load`), without a C compiler to build the launcher, for a program run
from memory (the compiled cache off: its kernels are no library file), or with
TVMGRAPH_OPENMP_THREADS=0, kernels run on TVM's pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("tvmgraph")

# TVM's calling convention (tvm/runtime/c_backend_api.h): a parallel lambda gets its task id and
# the group's size; a nonzero return is a failure. GOMP_parallel is libgomp's entry for
# `#pragma omp parallel`; Intel's and LLVM's OpenMP runtimes export it too.
SOURCE = r"""
#include <stdint.h>

typedef struct { void *sync_handle; int32_t num_task; } group_env;
typedef int (*parallel_lambda)(int task_id, group_env *env, void *cdata);

static void (*gomp_parallel)(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags);
static void (*gomp_barrier)(void);
static int (*omp_thread_num)(void);
static int (*omp_num_threads)(void);

void tvmgraph_openmp_init(void *parallel, void *barrier, void *thread_num, void *num_threads) {
    gomp_parallel = parallel;
    gomp_barrier = barrier;
    omp_thread_num = thread_num;
    omp_num_threads = num_threads;
}

struct job { parallel_lambda lambda; void *cdata; int failed; };

static void run_task(void *data) {
    struct job *job = data;
    /* The team may be smaller than asked (a launch inside another parallel region runs alone). */
    group_env env = {0, omp_num_threads()};
    if (job->lambda(omp_thread_num(), &env, job->cdata) != 0)
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
}

/* num_task 0 means as many threads as the caller's OpenMP setting (torch.set_num_threads). */
int tvmgraph_parallel_launch(parallel_lambda lambda, void *cdata, int num_task) {
    struct job job = {lambda, cdata, 0};
    gomp_parallel(run_task, &job, num_task > 0 ? (unsigned)num_task : 0u, 0u);
    return job.failed ? -1 : 0;
}

int tvmgraph_parallel_barrier(int task_id, group_env *env) {
    (void)task_id;
    (void)env;
    gomp_barrier();
    return 0;
}
"""

_OPENMP_RUNTIME = re.compile(r"/lib(gomp|iomp5|omp)[-.\w]*\.so[.\d]*$")


def loaded_openmp_runtime(maps: Path = Path("/proc/self/maps")) -> str | None:
    """The path of the OpenMP runtime this process has loaded (torch's libgomp), or None."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
        if len(fields) == 6 and _OPENMP_RUNTIME.search(fields[5]):
            return fields[5]
    return None


@functools.cache
def _launcher() -> ctypes.CDLL | None:
    """The launcher library bound to the loaded OpenMP runtime, or None where there is none."""
    runtime_path = loaded_openmp_runtime()
    if runtime_path is None:
        return None
    try:
        runtime = ctypes.CDLL(runtime_path)  # already loaded: the same handle, not a second runtime
        entries = [ctypes.cast(getattr(runtime, name), ctypes.c_void_p)
                   for name in ("GOMP_parallel", "GOMP_barrier", "omp_get_thread_num", "omp_get_num_threads")]
        launcher = _loaded_launcher()
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:
        logger.warning("CPU kernels run on TVM's own thread pool, beside torch's OpenMP threads (slower "
                       "right after eager ops): the OpenMP launcher could not be built or bound (%s: %s). "
                       "Install a C compiler (cc, or set $CC); docs/footguns.md.", type(e).__name__, e)
        return None
    launcher.tvmgraph_openmp_init(*entries)
    return launcher


def _loaded_launcher() -> ctypes.CDLL:
    """The launcher library, built again once when the cached file cannot be loaded (truncated,
    emptied, overwritten): a damaged cache is rebuilt, never trusted."""
    path = _built_launcher()
    try:
        launcher = ctypes.CDLL(str(path))
        launcher.tvmgraph_openmp_init  # noqa: B018 - a file without the entry is damaged too
        return launcher
    except (OSError, AttributeError):
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(_built_launcher()))


def _built_launcher() -> Path:
    """SOURCE compiled once per machine into the cache directory (written atomically)."""
    from .config import settings

    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    directory = settings.cache_dir / "runtime"
    path = directory / f"openmp_launch-{digest}.so"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as work:
        source = Path(work) / "openmp_launch.c"
        source.write_text(SOURCE)
        built = Path(work) / path.name
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                       check=True, capture_output=True)
        os.replace(built, path)
    return path


def load_library(path: str | os.PathLike) -> Any:
    """`tvm.runtime.load_module(path)` with its parallel kernels on the process's OpenMP threads.
    Every load goes through here: loading a library already loaded (a second graph with the same
    cache key) makes TVM point its launcher back at TVM's pool."""
    import tvm

    library = tvm.runtime.load_module(str(path))  # native code runs from here on
    use_openmp_threads(path)
    return library


def use_openmp_threads(library_path: str | os.PathLike) -> bool:
    """Make the loaded compiled library at `library_path` launch its parallel kernels on the
    process's OpenMP threads; False (TVM's pool stays) where that cannot be done."""
    from .config import settings

    launcher = _launcher() if settings.openmp_threads else None
    if launcher is None:
        return False
    try:
        library = ctypes.CDLL(str(library_path))  # the handle TVM's load_module opened
        launch = ctypes.c_void_p.in_dll(library, "__TVMBackendParallelLaunch")
    except (OSError, ValueError):
        return False  # a library without parallel kernels exports no launcher pointer
    launch.value = ctypes.cast(launcher.tvmgraph_parallel_launch, ctypes.c_void_p).value
    try:
        barrier = ctypes.c_void_p.in_dll(library, "__TVMBackendParallelBarrier")
        barrier.value = ctypes.cast(launcher.tvmgraph_parallel_barrier, ctypes.c_void_p).value
    except ValueError:
        pass  # no kernel with a barrier
    return True
