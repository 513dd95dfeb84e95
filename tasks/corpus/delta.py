"""Planning a build: a full one, or a delta on a base corpus (``corpus build SOURCES --base …``).

A delta parses only the sources whose sha256 its base does not hold. Its rows are deduplicated among
themselves and against the base's key index (``keyindex.py``); the grown corpus lists the base's
shards unchanged plus the delta's (``grow.py``). A row's split is its key's, so the grown corpus holds
the rows of a full build of all the sources, split alike (the kept copy of a text found in both the
base and the delta is the base's: the same row as a full build's whenever the delta's sources come
after the base's in source order, as new dated files do).

A delta only adds: a base source that is missing from SOURCES, or whose bytes changed, refuses the
delta, naming it, before any work (the user builds in full, without ``--base``), unless the build asked
to fall back to a full one (``fallback: full``, as the weekly ``corpus-refresh`` does), which then says why.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tasks.corpus.build import CorpusPlan, plan_corpus, plan_of
from tasks.corpus.config import CorpusConfig
from tasks.corpus.keyindex import BaseKeys
from tasks.corpus.manifest import Manifest, ManifestError, newest_manifest, read_manifest, shard_key
from tasks.store import Store


class DeltaRefused(ValueError):
    """A delta that cannot be built on its base: the one line says which source or setting, and why.

    ``reason`` is that line without the advice (what to pass instead), for a build that falls back to
    a full one and says why."""

    def __init__(self, reason: str, advice: str | None = None) -> None:
        super().__init__(f"{reason}; {advice}" if advice else reason)
        self.reason = reason


# What a refused delta tells the user to do, where building every source is the way out.
_BUILD_IN_FULL = "build all the sources in full, without --base (or with --fallback full)"


def plan_build(
    source_args: list[str],
    config: CorpusConfig,
    store: Store,
    *,
    s3_endpoint_url: str | None = None,
    cache_path: Path | None = None,
) -> CorpusPlan:
    """The plan of ``corpus build``: a full build, or with ``config.base`` a delta on that base.

    A delta with nothing new is the base itself: a plan whose manifest is already published. A delta
    that cannot be built raises ``DeltaRefused``; with ``config.fallback`` "full" it is the full build
    of all the sources instead, its ``full_build_reason`` the one line why. The corpus flow (the weekly
    ``corpus-refresh``), ``corpus build`` and ``pipeline --incremental`` all decide here.
    """
    plan = plan_corpus(source_args, config, s3_endpoint_url=s3_endpoint_url, cache_path=cache_path)
    if config.base is None:
        return plan
    try:
        return _delta_plan(plan, config, config.base, store)
    except DeltaRefused as refused:
        if config.fallback == "refuse":
            raise
        return dataclasses.replace(plan, full_build_reason=f"{refused.reason}; the corpus is built in full")


def _delta_plan(plan: CorpusPlan, config: CorpusConfig, base_uri: str, store: Store) -> CorpusPlan:
    """The delta of ``plan``'s sources on ``base_uri``, or ``DeltaRefused`` before any work."""
    base_key, base = resolve_base(base_uri, store)
    where = f"--base {base_uri}"
    if tuple(base.config.split) != config.split:
        wanted = ":".join(map(str, base.config.split))
        raise DeltaRefused(
            f"{where}: corpus {base.corpus_id} is split {wanted}; a delta keeps its base's split",
            f"pass --split {wanted}",
        )
    if base.keys is None:
        raise DeltaRefused(
            f"{where}: corpus {base.corpus_id} has no key index (built before deltas)", _BUILD_IN_FULL
        )
    given = {source.sha256 for source in plan.sources}
    by_name = {source.name: source for source in plan.sources}
    for held in base.sources:
        if held.sha256 in given:
            continue
        if held.name in by_name:
            raise DeltaRefused(
                f"{where}: source {held.name} changed since corpus {base.corpus_id} was built (sha256 "
                f"{held.sha256[:12]}…, now {by_name[held.name].sha256[:12]}…): a delta only adds sources",
                _BUILD_IN_FULL,
            )
        raise DeltaRefused(
            f"{where}: source {held.name} ({held.uri}) of corpus {base.corpus_id} is not among the SOURCES: "
            "a delta only adds sources",
            _BUILD_IN_FULL,
        )
    held_digests = {source.sha256 for source in base.sources}
    new = tuple(source for source in plan.sources if source.sha256 not in held_digests)
    prefix = base_key.rpartition("/")[0]
    if not new:  # nothing to add: the corpus is the base
        return dataclasses.replace(plan, corpus_id=base.corpus_id, prefix=prefix, sources=(), pieces=())
    files = tuple((shard_key(base_key, k.path), k.lo, k.hi) for k in base.keys)
    return plan_of(
        new,
        config,
        base=BaseKeys(corpus_id=base.corpus_id, manifest_key=base_key, files=files),
    )


def resolve_base(base: str, store: Store) -> tuple[str, Manifest]:
    """The key and manifest of the base in ``store``: a manifest URI (or its corpus folder) inside the
    store, or ``newest``, the corpus published last in it (``newest_manifest`` says how that is told).

    The grown corpus names the base's shards by paths relative to its own folder, so both live in one
    store.
    """
    uri = newest_manifest(store) if base == "newest" else base
    if uri is None:
        raise DeltaRefused(f"--base newest: no corpus is published in {store.url('')}")
    if "://" not in uri or uri.startswith("file://"):
        uri = str(Path(uri.removeprefix("file://")).expanduser().resolve())
    root = store.url("").rstrip("/")
    if not uri.startswith(root + "/"):
        raise DeltaRefused(f"--base {base}: the base must be a corpus in the store built into ({root})")
    key = uri[len(root) + 1 :].rstrip("/")
    if not key.endswith("manifest.json"):
        key += "/manifest.json"
    if not store.exists(key):
        raise DeltaRefused(f"--base {base}: no corpus manifest at {store.url(key)}")
    try:
        return key, read_manifest(store, key)
    except ManifestError as error:
        raise DeltaRefused(f"--base {base}: {error}") from None
