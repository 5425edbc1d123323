"""TVM's C++ chatter goes to tvmgraph's debug log, not to the user's terminal.

TVM's C++ code logs warnings straight to the process's stderr (file descriptor 2), out of
reach of Python's `logging` and `warnings`: code generation prints "Unknown pragma
pragma_scope" for TOPI's scatter kernel (the gradient of gather, so of every cross-entropy
training step), and a failed import prints "BlockBuilder destroyed with remaining blocks!"
when its builder is freed. None of it asks the user to act. `to_debug_log(stage)` points fd 2
at a temporary file while `stage` runs and logs what was written there at DEBUG.

Keep it around C++-heavy calls that log nothing themselves: a Python handler writing to stderr
inside it would be captured too (and come out at DEBUG).
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

from .debug import logger

# fd 2 is process-wide: one capture at a time; a nested one (same thread) joins the outer.
_lock = threading.RLock()
_depth = 0


@contextmanager
def to_debug_log(stage: str) -> Iterator[None]:
    """Run the body with fd 2 captured; log each captured line at DEBUG, tagged with `stage`."""
    global _depth
    with _lock:
        _depth += 1
        try:
            if _depth > 1:
                yield
                return
            try:
                saved = os.dup(2)
            except OSError:  # no fd 2 (a pythonw-like process): nothing to capture
                yield
                return
            with tempfile.TemporaryFile() as sink:
                sys.stderr.flush()
                os.dup2(sink.fileno(), 2)
                try:
                    yield
                except BaseException as e:
                    # Free what the failed call left on the stack (a Relax importer's
                    # BlockBuilder complains when it is destroyed) while fd 2 is still captured.
                    _clear_frames(e)
                    gc.collect()
                    raise
                finally:
                    os.dup2(saved, 2)
                    os.close(saved)
                    sink.seek(0)
                    for line in sink.read().decode(errors="replace").splitlines():
                        if line.strip():
                            logger.debug("TVM (%s): %s", stage, line)
        finally:
            _depth -= 1


def _clear_frames(error: BaseException) -> None:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
