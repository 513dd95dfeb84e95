"""A grown corpus's manifest: its base's shards unchanged, then the delta's, with its parent and what
the delta added.

The base's files stay where they are; the grown manifest names them by paths relative to its own
folder (``../<base id>/train/shard-….arrow``), resolved by ``manifest.shard_key`` like any other.
In each split the base's shards come first and the delta's last, so ``Manifest.delta_shards`` and
``Manifest.parent_shards`` part them by count (a continued pretraining run replays the parent's).
"""

from __future__ import annotations

import posixpath

from tasks.corpus.keyindex import BaseKeys
from tasks.corpus.manifest import Delta, DeltaSplit, Manifest, Parent, Split, Totals, read_manifest, shard_key
from tasks.store import Store


def grow_manifest(delta: Manifest, base_keys: BaseKeys, store: Store, prefix: str) -> Manifest:
    """The manifest of the corpus at ``prefix``: the base's (at ``base_keys.manifest_key``) plus
    ``delta``, the manifest of the delta's own rows and sources."""
    base_key = base_keys.manifest_key
    base = read_manifest(store, base_key)

    def moved(path: str) -> str:
        return posixpath.relpath(shard_key(base_key, path), prefix)

    splits = {}
    for name in dict.fromkeys([*base.splits, *delta.splits]):
        inherited = [s.model_copy(update={"path": moved(s.path)}) for s in base.shards(name)]
        splits[name] = Split.of([*inherited, *delta.shards(name)])
    keys = [k.model_copy(update={"path": moved(k.path)}) for k in base.keys or []] + list(delta.keys or [])
    sources = [*base.sources, *delta.sources]
    totals = Totals(
        records=sum(s.records for s in sources),
        kept=sum(s.kept for s in sources),
        duplicates=sum(s.duplicates for s in sources),
        rejected=sum(s.rejected for s in sources),
    )
    added = Delta(
        sources=[s.name for s in delta.sources],
        splits={
            name: DeltaSplit(rows=split.rows, text_bytes=split.text_bytes, shards=len(split.shards))
            for name, split in delta.splits.items()
        },
        totals=delta.totals,
    )
    return delta.model_copy(
        update={
            "splits": splits,
            "sources": sources,
            "totals": totals,
            "keys": keys,
            "rejected_files": [*base.rejected_files, *delta.rejected_files],
            "parent": Parent(corpus_id=base.corpus_id, manifest_uri=store.url(base_key)),
            "delta": added,
        }
    )
