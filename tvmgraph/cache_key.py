"""Cache keys built from named parts, each logged at DEBUG so that a miss can be explained.

    key = cache_key("LinearGraph_0", [("program", fx_text), ("target", target_json), ...])
        -> "LinearGraph-3f2a...c1" (graph class name + sha256 of all parts)

The same parts in the same order give the same key in any process. Each part's own short hash
is logged under the logger "tvmgraph.cache", so comparing two runs' logs shows which part
changed (a torch upgrade, a new batch size, an edited build()).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable

logger = logging.getLogger("tvmgraph.cache")

Part = tuple[str, str | bytes]


def _digest(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return hashlib.sha256(data).digest()


def cache_key(stem: str, parts: Iterable[Part]) -> str:
    """`<stem>-<sha256 over the named parts>`; logs each part's hash at DEBUG."""
    total = hashlib.sha256()
    for name, value in parts:
        digest = _digest(value)
        logger.debug("cache key %s: part %-12s %s", stem, name, digest.hex()[:16])
        total.update(name.encode())
        total.update(digest)
    key = f"{stem}-{total.hexdigest()[:40]}"
    logger.debug("cache key %s", key)
    return key
