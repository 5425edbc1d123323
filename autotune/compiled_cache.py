"""A persistent cache of compiled graphs: one directory per key, written atomically.

    <root>/<key>/lib-<id>.so   the compiled program (VM executable exported as a shared library)
    <root>/<key>/meta.pt       what the runtime needs besides code (torch.save of a dict),
                               plus the library's file name and sha256

An entry is first written into a temporary directory beside the final one and renamed into
place, so a crash never leaves a half-written entry under a real key. On load the library's
checksum is verified; an entry that fails to read, verify or load is reported, removed and
treated as a miss (the caller rebuilds it): a corrupt cache is never trusted.

Each library gets a file name of its own (`lib-<id>.so`): the dynamic loader reuses an already
loaded library by path, so a rebuilt entry must not reuse the old name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("tvmgraph.cache")

META = "meta.pt"


@dataclass
class Entry:
    """A loaded cache entry: the runtime module and its metadata."""

    lib: Any  # tvm.runtime.Module
    meta: dict[str, Any]
    lib_path: Path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CompiledCache:
    """Compiled graphs on disk under `root`, keyed by `autotune.cache_key.cache_key`."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def load(self, key: str) -> Entry | None:
        """The entry for `key`, or None on a miss or a corrupt entry (which is removed)."""
        import tvm

        path = self.root / key
        if not path.is_dir():
            return None
        try:
            meta = torch.load(path / META, weights_only=False)
            lib_path = path / meta["lib_name"]
            if _sha256(lib_path) != meta["lib_sha256"]:
                raise ValueError(f"{lib_path.name} does not match its recorded checksum")
            lib = tvm.runtime.load_module(str(lib_path))
        except Exception as e:  # anything unreadable means the entry cannot be trusted
            logger.warning("compiled cache entry %s is corrupt (%s: %s); removing it and rebuilding",
                           path, type(e).__name__, e)
            shutil.rmtree(path, ignore_errors=True)
            return None
        logger.debug("compiled cache hit: %s", path)
        return Entry(lib, meta, path / meta["lib_name"])

    def store(self, key: str, executable: Any, meta: dict[str, Any],
              export: Callable[[Any, str], None] | None = None) -> Path:
        """Export `executable` (with `export(executable, path)`, default its own
        `export_library`) and write `meta` as the entry for `key`; returns the library's path."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / key
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        lib_name = f"lib-{uuid.uuid4().hex[:12]}.so"
        try:
            (export or (lambda ex, path: ex.export_library(path)))(executable, str(tmp / lib_name))
            torch.save({**meta, "lib_name": lib_name, "lib_sha256": _sha256(tmp / lib_name)}, tmp / META)
            try:
                os.rename(tmp, final)
            except OSError:  # another process stored the same key first: use theirs
                shutil.rmtree(tmp, ignore_errors=True)
                return final / torch.load(final / META, weights_only=False)["lib_name"]
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final / lib_name
