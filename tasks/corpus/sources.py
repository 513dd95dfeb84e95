"""Raw review sources: find them, fingerprint them, and stream their lines in blocks.

A SOURCE argument is a file, a folder, a glob, an ``s3://`` prefix or an ``http(s)://`` URL. Every
problem with a source (missing, unreadable, empty folder, HTTP 404) is raised before any work
starts. Gzip is detected by its magic bytes, so a misnamed file still reads.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlparse

from tasks.secrets import hide, reveal, scrub
from tasks.store import MiB, S3Store

REVIEW_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".ndjson", ".ndjson.gz")
READ_CHUNK = 4 * MiB
# Compressed bytes per decompress call: what a corrupt spot can cost of the data before it.
INFLATE_SLICE = 64 * 1024
GZIP_MAGIC = b"\x1f\x8b"


class SourceError(ValueError):
    """A SOURCE that cannot be read; the message names it and says why."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """One raw file, identified by its content."""

    uri: str
    name: str
    size: int
    sha256: str
    gzip: bool
    # (byte offset, 1-based line number) where each piece of a plain local file starts; empty in the
    # source a piece carries (its own start is the piece's).
    piece_starts: tuple[tuple[int, int], ...] = ((0, 1),)

    @property
    def category(self) -> str:
        """The product category named by the file (``reviews_Musical_Instruments_5.json.gz``)."""
        stem = re.sub(r"(\.(json|jsonl|ndjson))?(\.gz)?$", "", self.name)
        stem = re.sub(r"^reviews_", "", stem)
        return re.sub(r"_5$", "", stem)


@dataclass(frozen=True, kw_only=True)
class Piece:
    """A unit of parallel parsing: a whole source, or a line-aligned byte range of a plain file."""

    piece_id: str
    source_index: int
    source: Source
    start: int = 0
    end: int | None = None
    first_line: int = 1
    estimated_bytes: int = field(default=0, compare=False)


# ---------------------------------------------------------------------------------------------
# Finding sources


def _is_review_file(name: str, suffixes: tuple[str, ...] = REVIEW_SUFFIXES) -> bool:
    return name.lower().endswith(suffixes)


def expand_sources(
    args: list[str], *, s3_endpoint_url: str | None = None, suffixes: tuple[str, ...] = REVIEW_SUFFIXES
) -> list[str]:
    """Turn SOURCE arguments into a sorted list of file URIs, or raise SourceError. A folder or an
    s3:// prefix contributes the files whose names end in one of ``suffixes`` (the scoring stage
    reads tables too)."""
    if not args:
        raise SourceError("no SOURCE given: name a file, folder, glob, s3:// prefix or http(s):// URL")
    found: list[str] = []
    for arg in args:
        scheme = urlparse(arg).scheme
        if scheme in ("http", "https"):
            shown = hide(arg)  # from here on, the URL without its credentials
            _check_http(shown)
            found.append(shown)
        elif scheme == "s3":
            found.extend(_expand_s3(arg, s3_endpoint_url, suffixes))
        elif any(ch in arg for ch in "*?[") and not Path(arg.removeprefix("file://")).exists():
            # A real file or folder whose name holds [ ] is taken as named, not as a pattern.
            matches = sorted(p for p in glob.glob(arg, recursive=True) if Path(p).is_file())
            if not matches:
                raise SourceError(f"SOURCE {arg!r}: the glob matches no file")
            found.extend(_check_local(Path(p)) for p in matches)
        else:
            path = Path(arg.removeprefix("file://"))
            if path.is_dir():
                files = sorted(
                    p for p in path.rglob("*") if p.is_file() and _is_review_file(p.name, suffixes)
                )
                if not files:
                    raise SourceError(
                        f"SOURCE {arg!r}: the folder holds no review files ({', '.join(suffixes)})"
                    )
                found.extend(_check_local(p) for p in files)
            else:
                found.append(_check_local(path))
    return sorted(set(found))


def _check_local(path: Path) -> str:
    if not path.exists():
        raise SourceError(f"SOURCE {str(path)!r}: no such file or folder")
    if not path.is_file():
        raise SourceError(f"SOURCE {str(path)!r}: not a regular file")
    if not os.access(path, os.R_OK):
        raise SourceError(f"SOURCE {str(path)!r}: not readable (permission denied)")
    return str(path.resolve())


def _http() -> Any:
    import urllib3

    # Connection drops, timeouts and 5xx answers may pass; an error of any other kind (a TLS handshake
    # with a plain-http server, a certificate refused) would fail again the same way: not retried.
    retries = urllib3.Retry(
        total=5,
        other=0,
        backoff_factor=0.5,
        status_forcelist=(429, 500, 502, 503, 504),
        raise_on_status=False,
    )
    return urllib3.PoolManager(retries=retries, timeout=urllib3.Timeout(connect=10, read=120))


def _get(url: str, headers: dict[str, str] | None = None, **options: Any) -> Any:
    """GET a (possibly hidden) source URL with its real credentials: user-info as basic auth, which
    urllib3 does not take from the URL itself."""
    import urllib3

    parts = urllib3.util.parse_url(reveal(url))
    headers = dict(headers or {})
    if parts.auth:
        user, _, password = parts.auth.partition(":")
        headers |= urllib3.make_headers(basic_auth=f"{unquote(user)}:{unquote(password)}")
    return _http().request(
        "GET", parts._replace(auth=None).url, headers=headers, preload_content=False, **options
    )


def _check_http(url: str) -> None:
    try:
        response = _get(url, headers={"Range": "bytes=0-0"})
        response.close()
    except Exception as error:  # urllib3 wraps every network failure differently
        if tls := re.search(r"\[SSL: ([A-Z_]+)\]", str(error)):
            raise SourceError(
                f"SOURCE {url!r}: the TLS handshake failed ({tls[1]}); if the server speaks plain HTTP, "
                "write http://"
            ) from None
        raise SourceError(f"SOURCE {url!r}: cannot be fetched ({scrub(str(error), url)})") from None
    if response.status >= 400:
        raise SourceError(f"SOURCE {url!r}: HTTP {response.status}")


def _expand_s3(uri: str, endpoint_url: str | None, suffixes: tuple[str, ...] = REVIEW_SUFFIXES) -> list[str]:
    store = S3Store(uri, endpoint_url=endpoint_url)
    bucket = S3Store(f"s3://{store.bucket}", endpoint_url=endpoint_url)
    try:
        # An exact object is taken as named (like a local file); anything else is a prefix.
        if store.prefix and not uri.endswith("/") and bucket.exists(store.prefix):
            return [uri]
        paginator = bucket.client.get_paginator("list_objects_v2")
        keys = [
            item["Key"]
            for page in paginator.paginate(Bucket=store.bucket, Prefix=store.prefix)
            for item in page.get("Contents", [])
        ]
    except Exception as error:
        raise SourceError(f"SOURCE {uri!r}: cannot be listed ({error})") from error
    files = [f"s3://{store.bucket}/{k}" for k in keys if _is_review_file(k, suffixes)]
    if not files:
        raise SourceError(f"SOURCE {uri!r}: no review files under this prefix")
    return files


# ---------------------------------------------------------------------------------------------
# Reading bytes


def open_raw(uri: str, *, s3_endpoint_url: str | None = None, start: int = 0) -> IO[bytes]:
    """A binary stream of a source's raw (possibly compressed) bytes, from byte ``start`` (a piece's:
    a local file or an S3 object, which are split into pieces; an http(s) file is one piece)."""
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        if start:
            raise ValueError(f"{uri}: an http(s) source is read from its start")
        # The file's own bytes, even when the server labels a .gz "Content-Encoding: gzip".
        response = _get(uri, decode_content=False)
        if response.status >= 400:
            raise SourceError(f"SOURCE {uri!r}: HTTP {response.status}")
        return response
    if scheme == "s3":
        head, _, name = uri.rpartition("/")
        return S3Store(head, endpoint_url=s3_endpoint_url).open_read(name, start=start)
    raw = open(uri, "rb")  # noqa: SIM115 (the caller's to close)
    raw.seek(start)
    return raw


def fingerprint(
    uri: str,
    *,
    piece_bytes: int,
    s3_endpoint_url: str | None = None,
    cache: FingerprintCache | None = None,
    on_read: Callable[[int], None] | None = None,
) -> Source:
    """Hash a source and, for a plain local file or S3 object, find line-aligned piece boundaries (an
    S3 piece is read by a ranged GET). ``on_read``: told the bytes hashed so far, a chunk at a time (a
    caller's progress)."""
    scheme = urlparse(uri).scheme
    local = scheme not in ("http", "https", "s3")
    splittable = scheme not in ("http", "https")  # a web server need not answer a Range request
    cache_key = None
    if local and cache is not None:
        stat = os.stat(uri)
        cache_key = f"{uri}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}|{piece_bytes}"
        if (hit := cache.get(cache_key)) is not None:
            return hit
    digest = hashlib.sha256()
    size = 0
    lines = 0
    starts: list[tuple[int, int]] = [(0, 1)]
    next_cut = piece_bytes
    is_gzip: bool | None = None
    with open_raw(uri, s3_endpoint_url=s3_endpoint_url) as raw:
        while chunk := raw.read(READ_CHUNK):
            if is_gzip is None:
                is_gzip = chunk[:2] == GZIP_MAGIC
            digest.update(chunk)
            if splittable and not is_gzip:
                # The first line start at or after each multiple of piece_bytes begins a piece.
                while size + len(chunk) > next_cut:
                    newline = chunk.find(b"\n", max(next_cut - size, 0))
                    if newline < 0:
                        break
                    offset = size + newline + 1
                    starts.append((offset, lines + chunk.count(b"\n", 0, newline + 1) + 1))
                    next_cut = offset + piece_bytes
                lines += chunk.count(b"\n")
            size += len(chunk)
            if on_read is not None:
                on_read(size)
    starts = [s for s in starts if s[0] < size] or [(0, 1)]
    source = Source(
        uri=uri,
        name=_name_of(uri),
        size=size,
        sha256=digest.hexdigest(),
        gzip=bool(is_gzip),
        piece_starts=tuple(starts),
    )
    if cache is not None and cache_key is not None:
        cache.put(cache_key, source)
    return source


def _name_of(uri: str) -> str:
    """The file name of a source. A URL's is in its path, not its query (a presigned URL's
    signature, say); S3 keys and local paths may hold '?' and '#' as plain characters."""
    if urlparse(uri).scheme in ("http", "https"):
        uri = unquote(urlparse(uri).path)
    return uri.rstrip("/").rpartition("/")[2]


class FingerprintCache:
    """sha256 of local files keyed by (path, size, mtime, inode), so an unchanged 40 GB corpus is
    not re-read just to learn that it is unchanged (the same rule make and rsync use)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._entries: dict[str, dict[str, Any]] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._entries = {}

    def get(self, key: str) -> Source | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry = {**entry, "piece_starts": tuple(tuple(s) for s in entry["piece_starts"])}
        return Source(**entry)

    def put(self, key: str, source: Source) -> None:
        self._entries[key] = asdict(source)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._entries))
        os.replace(tmp, self.path)


def pieces_of(source_index: int, source: Source) -> list[Piece]:
    """Split a source into pieces: a gzip file or an http(s) one is one piece, a plain local file or S3
    object several (``fingerprint`` found where)."""
    starts = source.piece_starts
    # Each piece's parse task is sent its piece: with every piece's start in it, that is O(N²).
    own = replace(source, piece_starts=())
    pieces = []
    for part, (start, first_line) in enumerate(starts):
        end = starts[part + 1][0] if part + 1 < len(starts) else None
        stop = source.size if end is None else end
        scale = 4 if source.gzip else 1  # reviews compress about 4:1
        pieces.append(
            Piece(
                piece_id=f"s{source_index:05d}-p{part:04d}",
                source_index=source_index,
                source=own,
                start=start,
                end=end,
                first_line=first_line,
                estimated_bytes=(stop - start) * scale,
            )
        )
    return pieces


# ---------------------------------------------------------------------------------------------
# Streaming lines


class StreamDamaged(Exception):
    """The compressed stream ended early or is corrupt; what came before it was delivered."""


def _decompressed(raw: IO[bytes]) -> Iterator[bytes]:
    """Decompress gzip (including multi-member files) chunk by chunk, keeping every byte that can
    be recovered before a truncation or corruption, then raising StreamDamaged."""
    inflater = zlib.decompressobj(wbits=31)
    fed = False  # has the current member seen any input?
    while chunk := raw.read(READ_CHUNK):
        for start in range(0, len(chunk), INFLATE_SLICE):
            data = chunk[start : start + INFLATE_SLICE]
            while data:
                fed = True
                before = inflater.copy()
                try:
                    out = inflater.decompress(data)
                except zlib.error as error:
                    yield from _salvage(before, data)
                    raise StreamDamaged(f"corrupt gzip data ({error})") from error
                if out:
                    yield out
                if not inflater.eof:
                    break
                # One member ended; what follows is the next member, or zero padding.
                data = inflater.unused_data.lstrip(b"\x00")
                inflater = zlib.decompressobj(wbits=31)
                fed = False
    if fed and not inflater.eof:
        if tail := inflater.flush():
            yield tail
        raise StreamDamaged("truncated gzip member (the file ends inside compressed data)")


def _salvage(inflater: Any, data: bytes) -> Iterator[bytes]:
    """The output of a call that fails is lost, so replay its input from a copy of the inflater
    taken before it, a few bytes at a time, keeping everything up to the bad spot."""
    for start in range(0, len(data), 256):
        try:
            out = inflater.decompress(data[start : start + 256])
        except zlib.error:
            return
        if out:
            yield out


@dataclass(frozen=True)
class Block:
    """Whole lines of a source. ``damaged`` is set on the last block of a truncated stream: its
    final line (without a newline) is what remained of the cut record."""

    first_line: int
    data: bytes
    damaged: str | None = None

    @functools.cached_property
    def num_lines(self) -> int:
        """Lines in the block, the last one counted even without its newline."""
        return self.data.count(b"\n") + (0 if self.data.endswith(b"\n") or not self.data else 1)


def iter_blocks(piece: Piece, *, block_bytes: int, s3_endpoint_url: str | None = None) -> Iterator[Block]:
    """Yield the piece's lines in blocks of about ``block_bytes``, always cut after a newline."""
    start = 0 if piece.source.gzip else piece.start
    with open_raw(piece.source.uri, s3_endpoint_url=s3_endpoint_url, start=start) as raw:
        if piece.source.gzip:
            chunks: Iterator[bytes] = _decompressed(raw)
        else:
            chunks = _ranged(raw, None if piece.end is None else piece.end - piece.start)
        line = piece.first_line
        pending: list[bytes] = []
        pending_size = 0
        try:
            for chunk in chunks:
                pending.append(chunk)
                pending_size += len(chunk)
                if pending_size < block_bytes:
                    continue
                data = b"".join(pending)
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    pending, pending_size = [data], len(data)
                    continue
                block = Block(line, data[:cut])
                yield block
                line += block.num_lines
                pending, pending_size = [data[cut:]], len(data) - cut
        except StreamDamaged as damage:
            yield Block(line, b"".join(pending), damaged=str(damage))
            return
        if pending_size:
            yield Block(line, b"".join(pending))


def _ranged(raw: IO[bytes], remaining: int | None) -> Iterator[bytes]:
    """The stream's next ``remaining`` bytes (None: to its end), a chunk at a time."""
    while remaining is None or remaining > 0:
        chunk = raw.read(READ_CHUNK if remaining is None else min(READ_CHUNK, remaining))
        if not chunk:
            return
        if remaining is not None:
            remaining -= len(chunk)
        yield chunk
