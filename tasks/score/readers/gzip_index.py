"""Reading a window of a gzip file from its offset in the uncompressed stream, through a seek-point index
(``indexed_gzip``): a read costs its own bytes and at most ``GZIP_SPACING`` more, where a gzip stream
read from its start costs every byte before the window."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any

from tasks.score.readers.folders import INDEXES, process_folder

# A gzip file's seek points, one every GZIP_SPACING bytes of its uncompressed stream, each holding the
# 32 KiB of text before it: a window read decompresses at most this much beside its own bytes, and a
# process's index of a file takes 1/512 of its uncompressed size (80 MB for 40 GB).
GZIP_SPACING = 16 * 2**20
GZIP_READ_BYTES = 2**20  # of compressed bytes an index reads at a time
FILES_KEPT = 2  # gzip files a process keeps open with their index: the one it reads, and the one before

# (path, sha256) → the open file and its index
_gzip_files: OrderedDict[tuple[str, str], tuple[IO[bytes], Any]] = OrderedDict()
_gzip_lock = threading.Lock()


def new_index(raw: IO[bytes]) -> Any:
    """A gzip file read through a seek-point index it builds as it is read."""
    import indexed_gzip

    return indexed_gzip.IndexedGzipFile(fileobj=raw, spacing=GZIP_SPACING, readbuf_size=GZIP_READ_BYTES)


def export_index(unzipped: Any, sha256: str) -> str:
    """Write the index to this process's folder of them, for the workers on this machine."""
    path = process_folder(INDEXES) / f"{sha256[:16] or 'file'}.gzidx"
    partial = path.with_suffix(".partial")
    unzipped.export_index(filename=str(partial))
    partial.replace(path)  # a worker never imports half an index
    return str(path)


def read_range(path: str, sha256: str, begin: int, end: int | None, index: str = "") -> bytes:
    """Bytes ``[begin, end)`` of a gzip file's uncompressed stream (``end`` None: to its end), through a
    seek-point index the process keeps for the file: the one describing exported (``index``) where this
    machine has it, then a read costs its own bytes and at most ``GZIP_SPACING`` more; otherwise one
    built as the process reads, which decompresses the file once, up to the furthest window the process
    reads, whatever their order. Kept open for the last ``FILES_KEPT`` files, by content (a Dask worker
    outlives a run)."""
    with _gzip_lock:
        if (kept := _gzip_files.get((path, sha256))) is None:
            raw = open(path, "rb")  # noqa: SIM115 (kept open across reads: _close); tests count its reads
            kept = raw, new_index(raw)
            if index and Path(index).is_file():
                try:
                    kept[1].import_index(filename=index)
                except OSError:  # not this file's, or unreadable: built here as the reads go
                    _close(*kept)
                    raw = open(path, "rb")  # noqa: SIM115 (as above)
                    kept = raw, new_index(raw)
            _gzip_files[(path, sha256)] = kept
            while len(_gzip_files) > FILES_KEPT:
                _close(*_gzip_files.popitem(last=False)[1])
        _gzip_files.move_to_end((path, sha256))
        unzipped = kept[1]
        unzipped.seek(begin)
        data: bytes = unzipped.read(-1 if end is None else end - begin)
        return data


def _close(raw: IO[bytes], unzipped: Any) -> None:
    unzipped.close()
    raw.close()


def drop_index(path: Path | None = None) -> None:
    """Close the process's index of ``path`` (of every file: None): its copy is being deleted."""
    with _gzip_lock:
        for key in [k for k in _gzip_files if path is None or k[0] == str(path)]:
            _close(*_gzip_files.pop(key))
