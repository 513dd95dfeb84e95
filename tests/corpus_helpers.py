"""Build a corpus with the plain functions, in this process: what the flow does, minus Prefect."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from tasks.corpus.build import (
    CorpusConfig,
    build_in_process,
    plan_corpus,
)
from tasks.corpus.manifest import Manifest
from tasks.corpus.reviews import CORPUS_SCHEMA
from tasks.store import LocalStore


def build(sources: list[str | Path], store_dir: Path, config: CorpusConfig | None = None) -> Manifest:
    return build_in_process(
        plan_corpus([str(s) for s in sources], config or CorpusConfig()), LocalStore(store_dir)
    )


def corpus_dir(store_dir: Path, manifest: Manifest) -> Path:
    return store_dir / "corpora" / manifest.corpus_id


def read_split(store_dir: Path, manifest: Manifest, split: str) -> pa.Table:
    base = corpus_dir(store_dir, manifest)
    tables = [pa.ipc.open_file(base / s.path).read_all() for s in manifest.shards(split)]
    return pa.concat_tables(tables) if tables else CORPUS_SCHEMA.empty_table()


def shard_digests(store_dir: Path, manifest: Manifest) -> list[tuple[str, str]]:
    base = corpus_dir(store_dir, manifest)
    return [
        (s.path, hashlib.sha256((base / s.path).read_bytes()).hexdigest())
        for split in manifest.splits.values()
        for s in split.shards
    ]


def rejected(store_dir: Path, manifest: Manifest) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for uri in manifest.rejected_files:
        rows.extend(pa.ipc.open_file(uri).read_all().to_pylist())
    return sorted(rows, key=lambda r: (r["source"], r["line"]))


def saved_manifest(store_dir: Path, manifest: Manifest) -> Manifest:
    return Manifest.model_validate(
        json.loads((corpus_dir(store_dir, manifest) / "manifest.json").read_text())
    )


def grow(
    sources: list[str | Path], store_dir: Path, base: str, config: CorpusConfig | None = None
) -> Manifest:
    """``corpus build SOURCES --base BASE`` in this process: the grown corpus (the base if nothing is new)."""
    from tasks.corpus.delta import plan_build
    from tasks.corpus.manifest import read_manifest

    store = LocalStore(store_dir)
    config = (config or CorpusConfig()).model_copy(update={"base": base})
    plan = plan_build([str(s) for s in sources], config, store)
    if store.exists(plan.manifest_key):
        return read_manifest(store, plan.manifest_key)
    return build_in_process(plan, store)


def manifest_uri(store_dir: Path, manifest: Manifest) -> str:
    return str(corpus_dir(store_dir, manifest) / "manifest.json")


# What `corpus build --json` prints (CorpusResult's fields), checked whole so that a key lost or added shows.
SUMMARY_KEYS = {"corpus_id", "manifest_uri", "rows", "duplicates", "rejected", "full_build_reason"}


def parsed_pieces(monkeypatch: Any) -> list[Any]:
    """The pieces a build parses from now on, in the order it reads them (in this process: a process
    pool's workers parse out of sight)."""
    import tasks.corpus.build

    parsed: list[Any] = []
    real_iter_blocks = tasks.corpus.build.iter_blocks

    def counting(piece: Any, **kwargs: Any) -> Any:
        parsed.append(piece)
        return real_iter_blocks(piece, **kwargs)

    monkeypatch.setattr(tasks.corpus.build, "iter_blocks", counting)
    return parsed
