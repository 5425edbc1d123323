"""Debug output of a graph, through the standard `logging` logger named "tvmgraph".

`graph.debug(v_level)` follows seed 001:
  0: warnings and the graph-building stages with their times;
  1: also the build info of each nn.Module (its inputs and outputs);
  2: also every op of the lowered program (name, inputs, result type);
  3: also where in the user's source each op came from.
Without debug mode only warnings and errors are emitted.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("tvmgraph")

MAX_V_LEVEL = 3


def current_rank() -> int:
    """Rank of this process in torch.distributed, or 0 when it is not initialized."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _ensure_visible() -> None:
    # Debug mode promises printed output, as OneFlow's does; attach a handler only if the
    # application has not configured logging itself.
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


class GraphLog:
    """The debug switch of one graph; every message is prefixed with the graph's tag."""

    __slots__ = ("tag", "enabled", "v_level")

    def __init__(self, tag: str):
        self.tag = tag
        self.enabled = False
        self.v_level = 0

    def configure(self, v_level: int, ranks: int | list[int] | None, mode: bool) -> None:
        from .errors import ConfigError

        if not _is_int(v_level) or not 0 <= v_level <= MAX_V_LEVEL:
            raise ConfigError(f"{self.tag} debug(): v_level must be an int in 0..{MAX_V_LEVEL}, got {v_level!r}")
        wanted = [0] if ranks is None else [ranks] if _is_int(ranks) else ranks
        if not isinstance(wanted, (list, tuple, range)) or not all(_is_int(r) for r in wanted):
            # ranks="0" was read as the list ["0"]: debug output silently off on rank 0
            raise ConfigError(f"{self.tag} debug(): ranks must be an int, a list of ints (-1: every rank) or "
                              f"None (rank 0), got {ranks!r}")
        if not isinstance(mode, bool):
            raise ConfigError(f"{self.tag} debug(): mode must be True (on) or False (off), got {mode!r}")
        self.enabled = mode and (-1 in wanted or current_rank() in wanted)
        self.v_level = v_level
        if self.enabled:
            _ensure_visible()

    def on(self, v_level: int) -> bool:
        return self.enabled and v_level <= self.v_level

    def info(self, v_level: int, msg: str) -> None:
        if self.on(v_level):
            logger.info("%s %s", self.tag, msg)

    def note(self, msg: str) -> None:
        """An INFO record whatever the debug level (like torch's recompile reasons): shown
        when the application logs "tvmgraph" at INFO, or under graph.debug()."""
        logger.info("%s %s", self.tag, msg)

    def warning(self, msg: str) -> None:
        logger.warning("%s %s", self.tag, msg)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Log the start and end of a stage with its wall time (v_level 0)."""
        self.info(0, f"start {name}.")
        t0 = time.perf_counter()
        yield
        self.info(0, f"end {name} ({time.perf_counter() - t0:.2f} s).")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
