"""The machine's limits: `python -m benchmarks.peak` (the measurement is tvmgraph/hardware.py)."""

from tvmgraph.hardware import bandwidth_gbs, fma_peak_gflops, main

__all__ = ["bandwidth_gbs", "fma_peak_gflops"]

if __name__ == "__main__":
    main()
