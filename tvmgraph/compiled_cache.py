"""A persistent cache of compiled graphs: one directory per key, checked before it is trusted.

    <root>/<key>/entry.json    format version, key, every other file with its sha256 and size,
                               the caller's metadata (JSON), and the sha256 of all of that
    <root>/<key>/lib-<id>.so   the compiled program (VM executable exported as a shared library)
    <root>/<key>/<data files>  what the caller's codec stores as raw bytes (constant tensors)

Nothing in an entry is a pickle: reading an entry parses JSON and raw bytes, and the library is
loaded (native code runs) only after every file matched its recorded sha256. The checksums catch
corruption and partial copies; they do not authenticate a writer: whoever can write into the
cache directory can write a library and its checksums, so keep the directory private
(it is created 0700).

An entry is written into a temporary directory beside the final one and renamed into place, so
a crash (even SIGKILL) never leaves a half-written entry under a real key; temporary directories
left by killed processes are swept after an hour. An entry that fails to read, verify or load is
reported once, removed and treated as a miss (the caller rebuilds it); an entry of an unknown
format version is a miss as well. After each store, least recently used entries are evicted
until the cache fits in `max_bytes` (the entry just stored always stays); a hit marks an entry
used by touching its entry.json.

Each library gets a file name of its own (`lib-<id>.so`): the dynamic loader reuses an already
loaded library by path, so a rebuilt entry must not reuse the old name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tvmgraph.artifact_format import ArtifactFormatError, document_digest, files_table, read_document, \
    verify_files, write_file
from tvmgraph.artifact_format import FILE_NAME as _FILE_NAME
from tvmgraph.artifact_format import document_digest as _document_digest  # noqa: F401 (tests build documents)
from tvmgraph.openmp_launch import load_library

logger = logging.getLogger("tvmgraph.cache")

FORMAT = 1  # bump when entry.json changes meaning; other versions are misses
ENTRY = "entry.json"
STALE_TEMP_SECONDS = 3600

# meta -> (JSON-able document, data files by name) and back; the data files come back verified.
Encode = Callable[[Any], tuple[Any, Mapping[str, bytes]]]
Decode = Callable[[Any, Mapping[str, bytes]], Any]


class CorruptEntryError(ValueError):
    """An entry that cannot be trusted (internal: it is removed and rebuilt, never raised to users)."""


class UnknownFormatError(CorruptEntryError):
    """An entry written in a format version this code does not read."""


@dataclass
class Entry:
    """A loaded cache entry: the runtime module and its decoded metadata."""

    lib: Any  # tvm.runtime.Module
    meta: Any
    lib_path: Path


@dataclass
class EntryInfo:
    """One entry as `tvmgraph cache list` shows it (read without verifying it)."""

    key: str
    path: Path
    size: int
    last_used: float  # seconds since the epoch


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class CompiledCache:
    """Compiled graphs on disk under `root`, keyed by `tvmgraph.cache_key.cache_key`.

    `encode`/`decode` turn the caller's metadata into a JSON document plus raw data files and
    back (default: the metadata is JSON already). `max_bytes=None` never evicts.
    """

    def __init__(self, root: Path, max_bytes: int | None = None, encode: Encode | None = None,
                 decode: Decode | None = None):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.encode: Encode = encode or (lambda meta: (meta, {}))
        self.decode: Decode = decode or (lambda doc, files: doc)

    # ---- reading ----

    def load(self, key: str) -> Entry | None:
        """The entry for `key`, or None on a miss or an untrusted entry (which is removed)."""
        path = self.root / key
        if not path.is_dir():
            return None
        try:
            doc, data = self._verify(path, key)
            meta = self.decode(doc["meta"], data)
            lib_path = path / doc["library"]
            lib = load_library(lib_path)  # only now does native code run
        except UnknownFormatError as e:
            logger.info("compiled cache entry %s: %s; rebuilding it", path, e)
            self._discard(path)
            return None
        except Exception as e:  # anything unreadable means the entry cannot be trusted
            logger.warning("compiled cache entry %s is corrupt (%s: %s); removing it and rebuilding",
                           path, type(e).__name__, e)
            self._discard(path)
            return None
        try:
            os.utime(path / ENTRY)  # last use, for eviction
        except OSError:  # evicted by another process meanwhile; the library is loaded already
            pass
        logger.debug("compiled cache hit: %s", path)
        return Entry(lib, meta, lib_path)

    def _verify(self, path: Path, key: str) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The entry's document and its data files, after checking every file against it."""
        try:
            doc = read_document(path / ENTRY)
        except ArtifactFormatError as e:
            raise CorruptEntryError(str(e)) from None
        if type(doc.get("format")) is not int or doc["format"] != FORMAT:
            raise UnknownFormatError(f"format {doc.get('format')!r} is not the format this tvmgraph "
                                     f"reads ({FORMAT})")
        if doc.get("sha256") != document_digest(doc):
            raise CorruptEntryError(f"{ENTRY} does not match its recorded checksum")
        if doc.get("key") != key:
            raise CorruptEntryError(f"{ENTRY} was written for key {doc.get('key')!r}")
        files = doc.get("files")
        data_files = [n for n in files if n != doc.get("library")] if isinstance(files, dict) else []
        try:
            data = verify_files(path, doc, ENTRY, read=data_files)
        except ArtifactFormatError as e:
            raise CorruptEntryError(str(e)) from None
        return doc, data

    def entries(self) -> list[EntryInfo]:
        """Every entry (not temporary directories), most recently used first."""
        if not self.root.is_dir():
            return []
        infos = []
        for path in self.root.iterdir():
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                marker = path / ENTRY
                used = (marker if marker.exists() else path).stat().st_mtime
                infos.append(EntryInfo(path.name, path, _tree_size(path), used))
            except OSError:  # removed meanwhile
                continue
        return sorted(infos, key=lambda e: e.last_used, reverse=True)

    # ---- writing ----

    def store(self, key: str, executable: Any, meta: Any,
              export: Callable[[Any, str], None] | None = None) -> Path:
        """Export `executable` (with `export(executable, path)`, default its own
        `export_library`) and write `meta` as the entry for `key`; returns the library's path
        (another process's, verified, when it stored the same key first)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.sweep()
        final = self.root / key
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        lib_name = f"lib-{uuid.uuid4().hex[:12]}.so"
        try:
            (export or (lambda ex, path: ex.export_library(path)))(executable, str(tmp / lib_name))
            with open(tmp / lib_name, "rb+") as f:
                os.fsync(f.fileno())
            meta_doc, data = self.encode(meta)
            for name, blob in data.items():
                if not _FILE_NAME.fullmatch(name) or name in (ENTRY, lib_name):
                    raise ValueError(f"data file name {name!r} is not a plain file name")
                write_file(tmp / name, blob)
            files = files_table(tmp, [lib_name, *data])
            doc = {"format": FORMAT, "key": key, "library": lib_name, "files": files, "meta": meta_doc}
            doc["sha256"] = document_digest(doc)
            write_file(tmp / ENTRY, json.dumps(doc, indent=1, sort_keys=True).encode())
            result = self._publish(tmp, final, key) or final / lib_name
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.evict(keep=key)
        return result

    def _publish(self, tmp: Path, final: Path, key: str) -> Path | None:
        """Rename `tmp` to `final`; None when ours is in place, else the library of the
        verified entry another process stored first."""
        for _ in range(2):
            try:
                os.rename(tmp, final)
                return None
            except OSError:  # `final` exists: another process stored this key
                pass
            if not final.is_dir():  # removed meanwhile: try our rename again
                continue
            try:
                doc, _ = self._verify(final, key)
            except Exception as e:  # theirs cannot be trusted
                logger.warning("compiled cache entry %s is corrupt (%s); replacing it", final, e)
                self._discard(final)
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            return final / doc["library"]
        raise OSError(f"could not store the compiled cache entry {final}: another process keeps replacing it")

    # ---- removing ----

    def _discard(self, path: Path) -> None:
        """Remove an entry: renamed away first, so nobody finds it half deleted."""
        trash = self.root / f".trash-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(path, trash)
        except OSError:  # already gone (another process removed it)
            return
        shutil.rmtree(trash, ignore_errors=True)

    def sweep(self, older_than: float = STALE_TEMP_SECONDS) -> int:
        """Remove temporary directories (of stores killed midway) older than `older_than`
        seconds; returns how many."""
        if not self.root.is_dir():
            return 0
        swept, now = 0, time.time()
        for path in self.root.iterdir():
            try:
                stale = path.name.startswith(".") and now - path.stat().st_mtime > older_than
            except OSError:
                continue
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                swept += 1
        if swept:
            logger.info("compiled cache: removed %d stale temporary directories under %s", swept, self.root)
        return swept

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used entries (never `keep`) until the cache fits in
        `max_bytes`; returns the evicted keys."""
        if self.max_bytes is None:
            return []
        entries = self.entries()
        total = sum(e.size for e in entries)
        evicted = []
        for entry in reversed(entries):  # least recently used first
            if total <= self.max_bytes:
                break
            if entry.key == keep:
                continue
            self._discard(entry.path)
            total -= entry.size
            evicted.append(entry.key)
            logger.info("compiled cache over its limit of %d bytes (TVMGRAPH_CACHE_MAX_BYTES): evicted %s "
                        "(%d bytes, last used %s)", self.max_bytes, entry.key, entry.size,
                        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.last_used)))
        return evicted

    def clear(self) -> list[EntryInfo]:
        """Remove every entry and temporary directory; returns the entries removed."""
        entries = self.entries()
        for entry in entries:
            self._discard(entry.path)
        self.sweep(older_than=-1)
        return entries
