"""The corpus stage as plain functions: plan → parse pieces → reduce buckets → manifest.

Every record gets a key, the XXH3-128 hash of its cleaned text. The key decides everything that must
never change when sources are added or the work is split differently:
- duplicates are records with equal keys; the first in (source, line) order is kept;
- the split is ``key_lo`` read as a number in [0, 1) against the configured fractions;
- the bucket is the top bits of ``key_hi`` (a range partition), and rows are written in key order,
  so the shards are the same bytes however many pieces or workers parsed them.

Layout under the store: ``corpora/<corpus_id>/`` holds ``{train,val,test}/shard-BBBBB-PPPP.arrow``
(bucket, part), ``rejected/<piece>.arrow``, ``manifest.json`` (written last), and ``_work/`` while
the build runs (piece outputs and completion markers, so a killed build resumes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from models.text import CLEANING, CLEANING_DESCRIPTION, END_PAD, FRONT_PAD
from tasks.corpus.config import CorpusConfig
from tasks.corpus.grow import grow_manifest
from tasks.corpus.keyindex import BaseKeys, held_by_base, write_key_file
from tasks.corpus.keys import bucket_of, split_of, text_keys
from tasks.corpus.lock import building
from tasks.corpus.manifest import (
    BuildSettings,
    Cleaning,
    KeyFile,
    Manifest,
    Shard,
    SourceCounts,
    Split,
    Totals,
    write_manifest,
)
from tasks.corpus.reviews import (
    CORPUS_SCHEMA,
    Rejects,
    clean_text_column,
    normalise,
    parse_block,
)
from tasks.corpus.sources import (
    FingerprintCache,
    Piece,
    Source,
    SourceError,
    expand_sources,
    fingerprint,
    iter_blocks,
    pieces_of,
)
from tasks.store import MiB, Store, StoreError, no_space

FORMAT = "mlstm-sentiment/corpus@1"
SPLITS = ("train", "val", "test")
KEY_COLUMNS = pa.schema(
    [("key_hi", pa.uint64()), ("key_lo", pa.uint64()), ("source_index", pa.int32()), ("line", pa.int64())]
)
WORK_SCHEMA = pa.schema(list(CORPUS_SCHEMA) + list(KEY_COLUMNS))
REJECT_SCHEMA = pa.schema(
    [("source", pa.string()), ("line", pa.int64()), ("reason", pa.string()), ("raw", pa.large_binary())]
)
EMPTY_TEXT = FRONT_PAD + END_PAD
BATCH_ROWS = 65536  # rows per record batch in a shard


@dataclass(frozen=True, kw_only=True)
class CorpusPlan:
    corpus_id: str
    prefix: str
    config: CorpusConfig
    sources: tuple[Source, ...]
    pieces: tuple[Piece, ...]
    num_buckets: int
    base: BaseKeys | None = None  # a delta's: the corpus it grows, deduplicated against its key index
    # A build asked to grow a base (``config.fallback`` "full") that is a full one instead: the one line why.
    full_build_reason: str | None = None

    @property
    def manifest_key(self) -> str:
        return f"{self.prefix}/manifest.json"

    @property
    def base_prefix(self) -> str | None:
        """A delta's base's folder (its lock is held while the delta builds)."""
        return self.base.manifest_key.rpartition("/")[0] if self.base else None

    def work_key(self, *parts: str) -> str:
        return "/".join((self.prefix, "_work", *parts))

    def for_tasks(self) -> CorpusPlan:
        """The plan a parse or reduce task is sent: without the pieces and the sources' piece starts.

        Every task is sent its arguments, and Prefect walks them for futures: the whole plan in each
        of N tasks is O(N²) (a 40 GB file's 640 pieces: 56 ms a task). A task needs the settings,
        the layout and how many sources there are, and its own piece carries its source.
        """
        sources = tuple(dataclasses.replace(source, piece_starts=()) for source in self.sources)
        return dataclasses.replace(self, sources=sources, pieces=())


def plan_corpus(
    source_args: list[str],
    config: CorpusConfig,
    *,
    s3_endpoint_url: str | None = None,
    cache_path: Path | None = None,
) -> CorpusPlan:
    """Resolve and fingerprint the sources; fix the corpus id, the pieces and the buckets."""
    uris = expand_sources(source_args, s3_endpoint_url=s3_endpoint_url)
    cache = FingerprintCache(cache_path) if cache_path else None
    # Threads suffice: sha256 and reads release the GIL, and a source is read once.
    with ThreadPoolExecutor(max_workers=min(4, len(uris))) as pool:
        sources = tuple(
            pool.map(
                lambda uri: fingerprint(
                    uri, piece_bytes=config.piece_mb * MiB, s3_endpoint_url=s3_endpoint_url, cache=cache
                ),
                uris,
            )
        )
    # Number sources by content, not location: the number decides which of two equal reviews is
    # kept, and the same files elsewhere must give the same shards (the URI only breaks ties).
    sources = tuple(sorted(sources, key=lambda s: (s.name, s.sha256, s.uri)))
    if cache is not None:
        cache.save()
    return plan_of(sources, config)


def plan_of(sources: tuple[Source, ...], config: CorpusConfig, *, base: BaseKeys | None = None) -> CorpusPlan:
    """The plan of fingerprinted ``sources``: a full build, or a delta on ``base`` (its id names the base)."""
    identity: dict[str, Any] = {
        "format": FORMAT,
        "cleaning": CLEANING,
        "config": config.identity(),
        "sources": sorted([s.name, s.sha256] for s in sources),
    }
    if base is not None:
        identity["parent"] = base.corpus_id
    corpus_id = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    pieces = tuple(p for index, source in enumerate(sources) for p in pieces_of(index, source))
    estimated = sum(p.estimated_bytes for p in pieces)
    num_buckets = max(1, math.ceil(estimated / (config.bucket_mb * MiB)))
    return CorpusPlan(
        corpus_id=corpus_id,
        prefix=f"corpora/{corpus_id}",
        config=config,
        sources=sources,
        pieces=pieces,
        num_buckets=num_buckets,
        base=base,
    )


# ---------------------------------------------------------------------------------------------
# Map: parse one piece into per-bucket files


@dataclass
class PieceResult:
    piece_id: str
    source_index: int
    records: int = 0
    rejected: int = 0
    bytes_read: int = 0
    rejected_key: str | None = None
    buckets: list[int] = field(default_factory=list)


def parse_piece(
    plan: CorpusPlan,
    piece: Piece,
    store: Store,
    *,
    s3_endpoint_url: str | None = None,
    on_block: Callable[[], None] | None = None,
) -> PieceResult:
    """Parse, clean and key one piece; append its rows to one file per bucket. Idempotent: a piece
    whose completion marker exists is not parsed again. ``on_block`` is called before each block: a
    caller's stop (``flows.stopping``) raises there, and the piece is left without its marker."""
    marker = plan.work_key("map", piece.piece_id, "_SUCCESS.json")
    if store.exists(marker):
        return PieceResult(**json.loads(store.read_bytes(marker)))
    result = PieceResult(piece.piece_id, piece.source_index)
    rejects = Rejects.empty()
    writers: dict[int, Any] = {}
    stack = _WriterStack(store)
    try:
        for block in iter_blocks(
            piece, block_bytes=plan.config.block_mb * MiB, s3_endpoint_url=s3_endpoint_url
        ):
            if on_block is not None:
                on_block()
            result.bytes_read += len(block.data)
            data = block.data
            if block.damaged:
                # The end of a damaged stream: a cut record, or nothing after a cut between records.
                # Either way the damage is recorded, so the summary says the file is incomplete.
                head, newline, tail = data.rpartition(b"\n")
                data = head + newline
                rejects.add(block.first_line + data.count(b"\n"), block.damaged, tail)
            num_lines = None if block.damaged else block.num_lines
            table = _keyed_rows(data, block.first_line, piece, rejects, num_lines)
            result.records += table.num_rows
            if table.num_rows:
                _scatter(table, plan, piece, writers, stack)
        # Every line read is a row for dedupe or a rejected record.
        result.records += len(rejects)
        result.buckets = sorted(writers)
        result.rejected = len(rejects)
        if rejects:
            result.rejected_key = f"{plan.prefix}/rejected/{piece.piece_id}.arrow"
            _write_rejects(store, result.rejected_key, piece.source.uri, rejects)
        stack.close_all()
    except BaseException as error:
        stack.abort_all(error)
        raise
    store.write_bytes(marker, json.dumps(result.__dict__).encode())
    # Hand the block buffers back, so a worker that goes on to reduce does not carry them.
    pa.default_memory_pool().release_unused()
    return result


def _keyed_rows(
    data: bytes, first_line: int, piece: Piece, rejects: Rejects, num_lines: int | None = None
) -> pa.Table:
    """Parse and clean a block; reject rows without text; add key, source and line columns."""
    if not data:
        return WORK_SCHEMA.empty_table()
    raw, lines = parse_block(data, first_line, rejects, num_lines)
    table = normalise(raw, piece.source.category)
    cleaned = clean_text_column(table["text"])
    usable = pc.fill_null(pc.not_equal(cleaned, EMPTY_TEXT), False)
    if not pc.all(usable).as_py():
        missing = np.flatnonzero(~usable.to_numpy(zero_copy_only=False))
        raw_lines = data.split(b"\n")
        for i in missing.tolist():
            line = int(lines[i])
            reason = "no review text" if table["text"][i].as_py() is None else "empty review text"
            rejects.add(line, reason, raw_lines[line - first_line])
        keep = pa.array(usable)
        table, cleaned, lines = (
            table.filter(keep),
            cleaned.filter(keep),
            lines[usable.to_numpy(zero_copy_only=False)],
        )
    table = table.set_column(0, "text", cleaned)
    key_hi, key_lo = text_keys(cleaned)
    return (
        table.append_column("key_hi", pa.array(key_hi))
        .append_column("key_lo", pa.array(key_lo))
        .append_column("source_index", pa.array(np.full(len(lines), piece.source_index, np.int32)))
        .append_column("line", pa.array(lines))
    )


class _WriterStack:
    """Open Arrow IPC stream writers on store-published files; all published or none."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.open: list[tuple[Any, Any, Any]] = []

    def new(self, key: str) -> Any:
        context = self.store.writer(key)
        path = context.__enter__()
        writer = pa.ipc.new_stream(str(path), WORK_SCHEMA)
        self.open.append((context, writer, key))
        return writer

    def close_all(self) -> None:
        while self.open:  # a close that fails (a full disk) leaves it and the rest to abort_all
            context, writer, _ = self.open[-1]
            writer.close()
            self.open.pop()
            context.__exit__(None, None, None)

    def abort_all(self, error: BaseException) -> None:
        """Discard every open file; a full disk is one StoreError naming the first (Arrow's words name
        none)."""
        first = self.open[0][2] if self.open else None
        for context, writer, _ in self.open:
            with contextlib.suppress(OSError, pa.ArrowException):  # a full disk fails the close too
                writer.close()
            context.__exit__(RuntimeError, RuntimeError("aborted"), None)
        self.open = []
        if first is not None and isinstance(error, OSError) and no_space(error):
            raise StoreError(f"{self.store.url(first)} cannot be written: no space left on device") from None


def _scatter(
    table: pa.Table, plan: CorpusPlan, piece: Piece, writers: dict[int, Any], stack: _WriterStack
) -> None:
    buckets = bucket_of(table["key_hi"].to_numpy(), plan.num_buckets)
    order = np.argsort(buckets, kind="stable")
    sorted_buckets = buckets[order]
    table = table.take(pa.array(order))
    bounds = np.flatnonzero(np.diff(sorted_buckets)) + 1
    starts = [0, *bounds.tolist()]
    ends = [*bounds.tolist(), len(order)]
    for start, end in zip(starts, ends, strict=True):
        bucket = int(sorted_buckets[start])
        if bucket not in writers:
            writers[bucket] = stack.new(plan.work_key("map", piece.piece_id, f"bucket-{bucket:05d}.arrow"))
        writers[bucket].write_table(table.slice(start, end - start))


def _write_rejects(store: Store, key: str, source_uri: str, rejects: Rejects) -> None:
    table = pa.table(
        {
            "source": pa.array([source_uri] * len(rejects), pa.string()),
            "line": pa.array(rejects.lines, pa.int64()),
            "reason": pa.array(rejects.reasons, pa.string()),
            "raw": pa.array(rejects.raw, pa.large_binary()),
        },
        schema=REJECT_SCHEMA,
    )
    with store.writer(key) as path, pa.ipc.new_file(str(path), REJECT_SCHEMA) as writer:
        writer.write_table(table)


# ---------------------------------------------------------------------------------------------
# Reduce: one bucket → deduplicated, split, sorted shards


@dataclass
class BucketResult:
    bucket: int
    shards: dict[str, list[Shard]] = field(default_factory=dict)
    kept: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)
    keys: KeyFile | None = None  # its file of the key index


def bucket_inputs(pieces: Iterable[PieceResult], num_buckets: int) -> list[tuple[str, ...]]:
    """For each bucket, the ids of the pieces that wrote to it, in (source, line) order: what its
    reduce reads. A reduce task is sent its own list, not every piece's result with every bucket
    it wrote (640 pieces × 320 buckets of a 40 GB file: over a second a task for Prefect to walk)."""
    inputs: list[list[str]] = [[] for _ in range(num_buckets)]
    for piece in sorted(pieces, key=lambda p: p.piece_id):
        for bucket in piece.buckets:
            inputs[bucket].append(piece.piece_id)
    return [tuple(ids) for ids in inputs]


def reduce_bucket(plan: CorpusPlan, bucket: int, store: Store, piece_ids: Iterable[str]) -> BucketResult:
    """Gather one bucket from the pieces that wrote to it (``piece_ids``, from ``bucket_inputs``),
    keep the first of each key, write shards per split."""
    marker = plan.work_key("reduce", f"bucket-{bucket:05d}.json")
    if store.exists(marker):
        saved = json.loads(store.read_bytes(marker))
        saved["shards"] = {s: [Shard(**i) for i in infos] for s, infos in saved["shards"].items()}
        saved["keys"] = KeyFile(**saved["keys"]) if saved.get("keys") else None
        return BucketResult(**saved)
    # Piece order is (source, line) order: the first row of a key in this order is the one kept.
    inputs = [plan.work_key("map", piece_id, f"bucket-{bucket:05d}.arrow") for piece_id in sorted(piece_ids)]
    with contextlib.ExitStack() as stack:
        # Memory-mapped: the bucket's rows are read in place, and only the kept ones are copied.
        tables = [
            pa.ipc.open_stream(pa.memory_map(str(stack.enter_context(store.local_copy(key))))).read_all()
            for key in inputs
        ]
        table = pa.concat_tables(tables) if tables else WORK_SCHEMA.empty_table()
        key_hi, key_lo = table["key_hi"].to_numpy(), table["key_lo"].to_numpy()
        # A stable sort by key keeps equal keys in input order; each run's head is a first occurrence.
        order = np.lexsort((key_lo, key_hi))
        sorted_hi, sorted_lo = key_hi[order], key_lo[order]
        head = np.ones(len(order), dtype=bool)
        head[1:] = (sorted_hi[1:] != sorted_hi[:-1]) | (sorted_lo[1:] != sorted_lo[:-1])
        first = np.zeros(len(order), dtype=bool)
        first[order[head]] = True
        if plan.base is not None:  # a delta: a key its base holds is a duplicate of the base's row
            firsts = np.flatnonzero(first)
            first[firsts[held_by_base(store, plan.base, key_hi[firsts], key_lo[firsts])]] = False
        kept_in_key_order = order[head][first[order[head]]]
        name = f"keys/bucket-{bucket:05d}.arrow"
        keys = write_key_file(store, plan.prefix, name, key_hi[kept_in_key_order], key_lo[kept_in_key_order])
        source_index = table["source_index"].to_numpy()
        num_sources = len(plan.sources)
        result = BucketResult(
            bucket=bucket,
            kept=np.bincount(source_index[first], minlength=num_sources).tolist(),
            duplicates=np.bincount(source_index[~first], minlength=num_sources).tolist(),
            keys=keys,
        )
        splits = split_of(key_lo, plan.config.fractions)
        rows = table.select(CORPUS_SCHEMA.names)
        for split_index, split in enumerate(SPLITS):
            # A filter copies rows in order (a gather in key order costs three times as much).
            part = rows.filter(pa.array(first & (splits == split_index)))
            result.shards[split] = _write_shards(store, plan, split, bucket, part)
            del part
    store.write_bytes(marker, json.dumps(_as_dict(result)).encode())
    return result


def _write_shards(store: Store, plan: CorpusPlan, split: str, bucket: int, table: pa.Table) -> list[Shard]:
    if table.num_rows == 0:
        return []
    lengths = pc.binary_length(table["text"]).to_numpy()
    limit = plan.config.shard_mb * MiB
    shards: list[Shard] = []
    start = 0
    cumulative = np.cumsum(lengths)
    while start < table.num_rows:
        base = cumulative[start - 1] if start else 0
        # At least one row; otherwise as many as fit in the shard size.
        end = max(start + 1, int(np.searchsorted(cumulative, base + limit, side="right")))
        part = table.slice(start, end - start)
        key = f"{plan.prefix}/{split}/shard-{bucket:05d}-{len(shards):04d}.arrow"
        with store.writer(key) as path, path.open("wb") as raw:
            sink = _HashingSink(raw)
            with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), CORPUS_SCHEMA) as writer:
                # Record batches of BATCH_ROWS whatever the input's chunks (so the bytes do not
                # depend on how the work was cut), each made contiguous on its own (so memory
                # holds one batch more, not one shard more).
                for offset in range(0, part.num_rows, BATCH_ROWS):
                    batch = part.slice(offset, BATCH_ROWS).combine_chunks()
                    batch.validate(full=True)  # every reader downstream trusts a shard: none is written bad
                    writer.write_table(batch)
            raw.flush()
            size, digest = sink.size, sink.sha256.hexdigest()
        shards.append(
            Shard(
                path=key.removeprefix(plan.prefix + "/"),
                rows=part.num_rows,
                bytes=size,
                text_bytes=int(cumulative[end - 1] - base),
                sha256=digest,
            )
        )
        start = end
    return shards


class _HashingSink:
    """A binary file that hashes what passes through, so a shard is not read back for its sha256."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        self.size += len(memoryview(data).cast("B"))
        return self.raw.write(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.closed = True


def _as_dict(result: BucketResult) -> dict[str, Any]:
    return {
        "bucket": result.bucket,
        "kept": result.kept,
        "duplicates": result.duplicates,
        "shards": {s: [i.model_dump() for i in infos] for s, infos in result.shards.items()},
        "keys": result.keys.model_dump() if result.keys else None,
    }


# ---------------------------------------------------------------------------------------------
# Publish


def build_manifest(
    plan: CorpusPlan, store: Store, pieces: Iterable[PieceResult], buckets: Iterable[BucketResult]
) -> Manifest:
    """The manifest: what the corpus holds and where every record of every source went."""
    pieces, buckets = list(pieces), sorted(buckets, key=lambda b: b.bucket)
    num_sources = len(plan.sources)
    records = [0] * num_sources
    rejected = [0] * num_sources
    rejected_files = []
    for piece in pieces:
        records[piece.source_index] += piece.records
        rejected[piece.source_index] += piece.rejected
        if piece.rejected_key:
            rejected_files.append(store.url(piece.rejected_key))
    # Per source, summed over the buckets (each holds one count per source).
    kept = [int(sum(b.kept[i] for b in buckets)) for i in range(num_sources)]
    duplicates = [int(sum(b.duplicates[i] for b in buckets)) for i in range(num_sources)]
    sources = []
    for i, source in enumerate(plan.sources):
        if records[i] != kept[i] + duplicates[i] + rejected[i]:
            raise RuntimeError(
                f"record counts of {source.uri} do not add up: {records[i]} read, {kept[i]} kept, "
                f"{duplicates[i]} duplicates, {rejected[i]} rejected"
            )
        sources.append(
            SourceCounts(
                uri=source.uri,
                name=source.name,
                category=source.category,
                sha256=source.sha256,
                bytes=source.size,
                records=records[i],
                kept=kept[i],
                duplicates=duplicates[i],
                rejected=rejected[i],
            )
        )
    splits = {split: Split.of([s for b in buckets for s in b.shards.get(split, [])]) for split in SPLITS}
    manifest = Manifest(
        format=FORMAT,
        corpus_id=plan.corpus_id,
        uri=store.url(plan.prefix),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        cleaning=Cleaning(
            name=CLEANING, description=CLEANING_DESCRIPTION, front_pad=FRONT_PAD, end_pad=END_PAD
        ),
        dedupe="exact cleaned text (XXH3-128 key); the first record in source and line order is kept",
        split_rule="key_lo / 2**64 against the split fractions (stable across source sets)",
        config=BuildSettings.model_validate(plan.config.identity()),
        columns={f.name: str(f.type) for f in CORPUS_SCHEMA},
        splits=splits,
        sources=sources,
        totals=Totals(
            records=sum(records), kept=sum(kept), duplicates=sum(duplicates), rejected=sum(rejected)
        ),
        rejected_uri=store.url(f"{plan.prefix}/rejected/"),
        rejected_files=sorted(rejected_files),
        keys=[b.keys for b in buckets if b.keys is not None],
    )
    # A delta's manifest lists its base's shards, then its own.
    return grow_manifest(manifest, plan.base, store, plan.prefix) if plan.base else manifest


def publish_manifest(plan: CorpusPlan, store: Store, manifest: Manifest) -> str:
    """Write the manifest last, then drop the work files. Returns the manifest URI.

    A corpus of no row is not published: its count would mean nothing, and the rejected lines say why.
    """
    totals = manifest.totals
    if totals.kept == 0:
        store.delete_prefix(plan.work_key())
        names = ", ".join(source.uri for source in manifest.sources)
        where = f"; the rejected lines are in {manifest.rejected_uri}" if totals.rejected else ""
        raise SourceError(
            f"no review could be read from {names}: {totals.records} records, "
            f"{totals.rejected} rejected{where}; nothing was published"
        )
    uri = write_manifest(store, plan.manifest_key, manifest)
    store.delete_prefix(plan.work_key())
    return uri


def build_in_process(plan: CorpusPlan, store: Store) -> Manifest:
    """The corpus of a plan built and published in this process, piece after piece, without Prefect (a
    machine with no Prefect, a test); its manifest. The flow runs the same steps on a task runner."""
    with building(store, plan.prefix, plan.corpus_id, grows=plan.base_prefix):
        pieces = [parse_piece(plan, piece, store) for piece in plan.pieces]
        inputs = bucket_inputs(pieces, plan.num_buckets)
        buckets = [reduce_bucket(plan, bucket, store, inputs[bucket]) for bucket in range(plan.num_buckets)]
        manifest = build_manifest(plan, store, pieces, buckets)
        publish_manifest(plan, store, manifest)
    return manifest


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
