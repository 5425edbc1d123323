"""The machine's limits, measured: fp32 FMA peak and memory bandwidth, on every core.

    python -m benchmarks.peak          (prints both)
    tvmgraph.hardware.limits()         (both, measured once per machine and cached; measured
                                        again when a short FMA loop beats the saved peak)

A kernel's speed means little against torch alone (MKL and oneDNN differ across CPUs); against
these two figures it says how much of the machine it uses (`graph.profile`, benchmarks/). Both
are small C programs compiled here with the host's C compiler for this CPU (-march=native,
OpenMP):

- FMA peak: each thread runs independent chains of vector FMAs on registers only (enough
  chains to cover the FMA latency on every pipe), so nothing but the FMA units limits it;
- bandwidth: each thread copies its share of two 256 MiB arrays (a STREAM "copy"; bytes read
  plus bytes written), far larger than the caches.

`benchmarks.peak` also prints the core-to-core round trip of a cache line (`core_round_trip_ns`),
which a VM's host changes as it moves the vCPUs.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import platform
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <stddef.h>
#include <string.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1 _mm512_set1_ps
#define SUM(v) _mm512_reduce_add_ps(v)
#else
typedef __m256 vec;
#define LANES 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1 _mm256_set1_ps
static float SUM(__m256 v) { float t[8]; _mm256_storeu_ps(t, v); float s = 0; for (int i = 0; i < 8; i++) s += t[i]; return s; }
#endif

/* FLOPs done (2 per FMA lane) by every thread running `iters` rounds of 12 independent chains. */
double fma_flops(long iters, float *sink) {
    double total = 0;
    #pragma omp parallel reduction(+:total)
    {
        vec a = SET1(1.0f), b = SET1(0.999999f);
        vec c0 = SET1(0), c1 = SET1(1), c2 = SET1(2), c3 = SET1(3), c4 = SET1(4), c5 = SET1(5);
        vec c6 = SET1(6), c7 = SET1(7), c8 = SET1(8), c9 = SET1(9), c10 = SET1(10), c11 = SET1(11);
        for (long i = 0; i < iters; i++) {
            c0 = FMA(c0, b, a); c1 = FMA(c1, b, a); c2 = FMA(c2, b, a); c3 = FMA(c3, b, a);
            c4 = FMA(c4, b, a); c5 = FMA(c5, b, a); c6 = FMA(c6, b, a); c7 = FMA(c7, b, a);
            c8 = FMA(c8, b, a); c9 = FMA(c9, b, a); c10 = FMA(c10, b, a); c11 = FMA(c11, b, a);
        }
        vec s = c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11;
        sink[omp_get_thread_num()] = SUM(s);
        total += 2.0 * 12 * LANES * (double)iters;
    }
    return total;
}

void copy(float *dst, const float *src, size_t n) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) dst[i] = src[i];
}

int threads(void) { return omp_get_max_threads(); }

/* Nanoseconds per round trip of one cache line between two threads, each spinning on a flag
   the other sets; 0 with fewer than two cores or when OpenMP gives fewer than two threads
   (OMP_THREAD_LIMIT=1: one thread would wait for itself). A thread that has spun long yields,
   so that two threads sharing one core (a CPU quota) still finish. */
static void wait_for(int *flag, int value) {
    int spins = 0;
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) != value)
        if (++spins > 4096) { sched_yield(); spins = 0; }
}

double round_trip_ns(long rounds) {
    static int flag __attribute__((aligned(64)));
    double ns = 0;
    if (omp_get_num_procs() < 2) return 0;
    __atomic_store_n(&flag, 0, __ATOMIC_SEQ_CST);
    #pragma omp parallel num_threads(2)
    {
        int me = omp_get_thread_num();
        long todo = omp_get_num_threads() == 2 ? rounds : 0;
        #pragma omp barrier
        double start = omp_get_wtime();
        for (long i = 0; i < todo; i++) {
            if (me == 0) {
                __atomic_store_n(&flag, 1, __ATOMIC_RELEASE);
                wait_for(&flag, 0);
            } else {
                wait_for(&flag, 1);
                __atomic_store_n(&flag, 0, __ATOMIC_RELEASE);
            }
        }
        if (me == 0 && todo > 0) ns = (omp_get_wtime() - start) * 1e9 / todo;
    }
    return ns;
}
"""


@functools.cache
def _library() -> ctypes.CDLL:
    # The loaded library stays mapped after its directory is removed (each run left one in /tmp).
    with tempfile.TemporaryDirectory(prefix="tvmgraph-peak-") as tmp:
        workdir = Path(tmp)
        (workdir / "peak.c").write_text(SOURCE)
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(workdir / "peak.so"),
                        str(workdir / "peak.c")], check=True)
        lib = ctypes.CDLL(str(workdir / "peak.so"))
    lib.fma_flops.restype = ctypes.c_double
    lib.fma_flops.argtypes = [ctypes.c_long, ctypes.POINTER(ctypes.c_float)]
    lib.copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.round_trip_ns.restype = ctypes.c_double
    lib.round_trip_ns.argtypes = [ctypes.c_long]
    return lib


def fma_peak_gflops(seconds: float = 0.5, repeats: int = 5) -> float:
    """The best of `repeats` runs of the FMA loop, in GFLOP/s over all threads."""
    import time

    lib = _library()
    sink = (ctypes.c_float * 256)()
    iters = 1 << 20
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        flops = lib.fma_flops(iters, sink)
        elapsed = time.perf_counter() - start
        best = max(best, flops / elapsed / 1e9)
        iters = max(1 << 16, int(iters * seconds / max(elapsed, 1e-6)))
    return best


def bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """The best of `repeats` parallel copies of `mib` MiB, in GB/s (read + written)."""
    import time

    import numpy as np

    lib = _library()
    n = mib * (1 << 20) // 4
    src, dst = np.ones(n, np.float32), np.zeros(n, np.float32)
    lib.copy(dst.ctypes.data, src.ctypes.data, n)  # first touch
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        lib.copy(dst.ctypes.data, src.ctypes.data, n)
        best = max(best, 2 * n * 4 / (time.perf_counter() - start) / 1e9)
    return best


def core_round_trip_ns(rounds: int = 200_000) -> float | None:
    """Nanoseconds for a cache line to go from one core to another and back (two threads
    passing a flag), None on one core or one OpenMP thread. Not one of the limits: a virtual machine's host moves
    its vCPUs between cores that share an L3 and cores that do not. On the 2-vCPU Zen 3 VM it
    was 130-145 ns or 455-500 ns, and tvmgraph's ViT inference call 10.7 or 15.8 ms with it
    (docs/benchmarks.md, 2026-11-29): every kernel hands its output from thread to thread."""
    ns = _library().round_trip_ns(rounds)
    return ns if ns > 0 else None


@dataclass(frozen=True)
class Limits:
    """What one machine can do at most, measured on all its threads."""

    cpu: str
    threads: int
    fma_gflops: float      # fp32, 2 FLOP per multiply-add lane
    bandwidth_gbs: float   # bytes read plus bytes written per second (copy)

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a kernel is bound by the FMA units, not by memory."""
        return self.fma_gflops / self.bandwidth_gbs


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# A saved FMA peak that a short FMA loop now beats by more than this was measured while other
# processes ran on the cores: measured again.
STALE_MARGIN = 1.05


@functools.cache
def limits(remeasure: bool = False) -> Limits:
    """This machine's limits: measured once (a few seconds) and kept in the cache directory.

    Keyed by CPU model and thread count; a cache file that does not parse is measured again, and
    `remeasure` measures again anyway (`python -m benchmarks.peak` does: measure on a quiet
    machine, any other process on the cores lowers both figures). A saved record is checked
    against a short FMA loop (0.1 s) and measured again when the loop beats it: on the Zen 3 VM
    a peak saved during a test run (131 GFLOP/s, the machine's is 203) had every profile show
    products at 140% of the FMA peak.
    """
    from .artifact_format import write_atomically
    from .config import settings

    cpu, threads = cpu_name(), _library().threads()
    path = settings.cache_dir / "hardware.json"
    try:
        saved = {} if remeasure else json.loads(path.read_text())
        if saved.get("cpu") == cpu and saved.get("threads") == threads:
            kept = Limits(**{k: saved[k] for k in ("cpu", "threads", "fma_gflops", "bandwidth_gbs")})
            if fma_peak_gflops(seconds=0.03, repeats=3) <= kept.fma_gflops * STALE_MARGIN:
                return kept
    except (OSError, ValueError, TypeError, KeyError):
        pass
    measured = Limits(cpu, threads, fma_peak_gflops(), bandwidth_gbs())
    try:
        write_atomically(path, json.dumps(asdict(measured), indent=1).encode())
    except OSError:
        pass  # a read-only cache directory: measure again next process
    return measured


def main() -> None:
    measured = limits(remeasure=True)
    print(f"CPU: {measured.cpu}")
    print(f"threads: {measured.threads} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    print(f"fp32 FMA peak: {measured.fma_gflops:.1f} GFLOP/s")
    print(f"memory bandwidth (copy): {measured.bandwidth_gbs:.1f} GB/s")
    trip = core_round_trip_ns()
    if trip is not None:  # varies with where a VM's vCPUs run; not cached with the limits
        print(f"core-to-core round trip: {trip:.0f} ns (now; higher when the cores share no L3)")


if __name__ == "__main__":
    main()
