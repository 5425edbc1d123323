"""What a tuning run found: per kernel and for the whole graph, printable and plottable."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .log import KernelChoice


@dataclass
class TuningReport:
    graph: str                      # the tuning log's graph name
    target: str
    log_dir: Path
    kernels: list[KernelChoice]     # the tuned kernels, slowest first
    untuned_kernels: int            # kernels left with the default schedule without tuning
    trials: int                     # measured in this run
    seconds: float
    graph_untuned_ms: float | None = None
    graph_tuned_ms: float | None = None
    eager_ms: float | None = None
    enabled: bool = True
    history: list[tuple[int, float]] = field(default_factory=list)  # (trials, estimated program µs)

    @property
    def speedup(self) -> float | None:
        if self.graph_untuned_ms and self.graph_tuned_ms:
            return self.graph_untuned_ms / self.graph_tuned_ms
        return None

    def table(self) -> str:
        """One row per tuned kernel, then the graph's times."""
        rows = [("kernel", "calls", "GFLOP", "default µs", "tuned µs", "speedup", "trials", "used")]
        for k in self.kernels:
            speed = f"{k.default_us / k.tuned_us:.2f}x" if k.default_us and k.tuned_us else "-"
            rows.append((k.name[:40], str(k.calls), f"{k.flops / 1e9:.3f}", _us(k.default_us), _us(k.tuned_us),
                         speed, str(k.trials), "tuned" if k.use_tuned else "default"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                 for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"({self.untuned_kernels} smaller kernel(s) keep the default schedule)")
        whole = [f"graph {self.graph} on {self.target}:"]
        if self.eager_ms is not None:
            whole.append(f"eager {self.eager_ms:.3f} ms")
        if self.graph_untuned_ms is not None:
            whole.append(f"untuned {self.graph_untuned_ms:.3f} ms")
        if self.graph_tuned_ms is not None:
            whole.append(f"tuned {self.graph_tuned_ms:.3f} ms")
        if self.speedup is not None:
            whole.append(f"({self.speedup:.2f}x untuned)")
        lines.append(" ".join(whole))
        if not self.enabled:
            lines.append("the tuned program measured slower than the untuned one: compiles keep the default "
                         "schedules")
        lines.append(f"{self.trials} trial(s) in {self.seconds:.0f} s; log: {self.log_dir}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | Path) -> Path:
        """Estimated program time (sum over kernels of calls x best µs so far) against trials."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        if self.history:
            xs, ys = zip(*self.history)
            ax.step(xs, ys, where="post")
        ax.set_xlabel("trials")
        ax.set_ylabel("estimated time of the tuned kernels (µs)")
        ax.set_title(f"tuning {self.graph} ({self.target})")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return Path(path)


def _us(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"
