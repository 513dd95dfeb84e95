"""A corpus that grows by a delta (``corpus build SOURCES --base``), with the plain functions: small
generated files, a few seconds."""

from __future__ import annotations

import gzip
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from corpus_helpers import build, corpus_dir, grow, manifest_uri, parsed_pieces, read_split

from tasks.corpus import keyindex
from tasks.corpus.build import SPLITS, CorpusConfig
from tasks.corpus.delta import DeltaRefused
from tasks.corpus.lock import BuildInProgress
from tasks.corpus.manifest import Manifest, newest_manifest, read_manifest
from tasks.corpus.sample import write_sample
from tasks.store import LocalStore

SPLIT = CorpusConfig(split=(6, 2, 2))  # every split holds rows of a few hundred reviews


def _lines(path: Path) -> list[bytes]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as stream:
        return [line.rstrip(b"\n") for line in stream if line.strip()]


def _delta_file(folder: Path, name: str, base_gift_cards: Path, seed: int) -> Path:
    """New 2018-format reviews, plus copies of the base's: some exact, some with another reviewer (the
    same text, other metadata), and one new review twice."""
    folder.mkdir(parents=True, exist_ok=True)
    old = _lines(base_gift_cards)
    new = _lines(write_sample(folder / f"gen-{seed}", num_reviews=150, seed=seed)[1])
    other_reviewer = [
        json.dumps({**json.loads(line), "reviewerID": "ANOTHER"}).encode() for line in old[10:15]
    ]
    path = folder / name
    path.write_bytes(b"\n".join([*new[:20], *old[:10], *other_reviewer, new[0], *new[20:]]) + b"\n")
    return path


def _rows(store: Path, manifest: Manifest, split: str) -> pa.Table:
    """A split's rows, every column, in one order whatever the shards."""
    table = read_split(store, manifest, split)
    return table.sort_by([(name, "ascending") for name in ("text", "reviewer_id", "product_id")])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], Manifest]:
    root = tmp_path_factory.mktemp("delta")
    sources = write_sample(root / "raw", num_reviews=300, seed=1)
    return root, sources, build(sources, root / "store", SPLIT)


def _grown_store(root: Path, base: Manifest, tmp_path: Path) -> Path:
    """A copy of the base's store, so each test grows its own."""
    import shutil

    shutil.copytree(root / "store", tmp_path / "store")
    return tmp_path / "store"


def test_a_grown_corpus_holds_a_full_builds_rows_and_reads_no_base_source(
    base: tuple[Path, list[Path], Manifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, sources, first = base
    store = _grown_store(root, first, tmp_path)
    gift_cards = next(s for s in sources if s.name.startswith("Gift"))
    # Later files sort last, as dated dumps do: the base's copy of a text is the full build's too.
    delta = _delta_file(tmp_path / "new", "zz_Gift_Cards_5.json", gift_cards, seed=2)
    parsed = parsed_pieces(monkeypatch)
    grown = grow([*sources, delta], store, manifest_uri(store, first), SPLIT)
    assert [p.source.name for p in parsed] == [delta.name]  # the base's sources are not read again
    monkeypatch.undo()
    full = build([*sources, delta], tmp_path / "full", SPLIT)

    for split in SPLITS:
        assert _rows(store, grown, split).equals(_rows(tmp_path / "full", full, split)), split
    assert grown.totals == full.totals
    assert sorted(s.model_dump().items() for s in grown.sources) == sorted(
        s.model_dump().items() for s in full.sources
    )
    # The manifest: the base's shards unchanged and first, its parent, what the delta added.
    assert grown.corpus_id not in (first.corpus_id, full.corpus_id)
    assert grown.parent is not None and grown.parent.corpus_id == first.corpus_id
    assert grown.parent.manifest_uri == manifest_uri(store, first)
    assert grown.delta is not None and grown.delta.sources == [delta.name]
    added = grown.delta.totals
    assert added.records == len(_lines(delta)) == added.kept + added.duplicates + added.rejected
    assert added.duplicates >= 16  # 15 copies of the base's, one of its own (and the generator's repeats)
    assert added.kept == sum(s.rows for s in grown.delta.splits.values())
    for split in SPLITS:
        inherited = [s.sha256 for s in grown.parent_shards(split)]
        assert inherited == [s.sha256 for s in first.shards(split)]
        assert sum(s.rows for s in grown.delta_shards(split)) == grown.delta.splits[split].rows
    assert sorted(p.name for p in (store / "corpora").iterdir()) == sorted([first.corpus_id, grown.corpus_id])
    assert not list((store / "corpora" / first.corpus_id).glob("_*"))  # no lock or work left in the base
    assert read_manifest(LocalStore(store), f"corpora/{grown.corpus_id}/manifest.json") == grown

    # Pretraining reads it as one stream: the base's text, then the delta's.
    from tasks.pretrain.stage import read_corpus_manifest
    from tasks.pretrain.stream import open_split

    read_corpus_manifest(manifest_uri(store, grown))  # every shard found, the base's through ../
    stream = open_split(manifest_uri(store, grown), "train", tmp_path / "cache")
    texts = read_split(store, grown, "train")["text"].to_pylist()
    assert stream.read(0, len(stream)).tobytes() == "".join(texts).encode()
    assert len(stream) == grown.splits["train"].text_bytes

    # A delta on the grown corpus (newest): a chain, still a full build's rows.
    later = _delta_file(tmp_path / "later", "zzz_Gift_Cards_5.json", delta, seed=3)
    again = grow([*sources, delta, later], store, "newest", SPLIT)
    assert again.parent is not None and again.parent.corpus_id == grown.corpus_id
    everything = build([*sources, delta, later], tmp_path / "full2", SPLIT)
    for split in SPLITS:
        assert _rows(store, again, split).equals(_rows(tmp_path / "full2", everything, split)), split
    assert again.totals == everything.totals


def test_a_delta_sorting_first_keeps_the_bases_copy_of_a_shared_text(
    base: tuple[Path, list[Path], Manifest], tmp_path: Path
) -> None:
    """The rule's one difference from a full build: where a text is in both, the base's row is kept
    (its shards are not rewritten), so the same texts in the same splits, and the base's metadata where
    a full build keeps the delta's copy."""
    root, sources, first = base
    store = _grown_store(root, first, tmp_path)
    gift_cards = next(s for s in sources if s.name.startswith("Gift"))
    delta = _delta_file(tmp_path / "new", "AA_Gift_Cards_5.json", gift_cards, seed=2)  # sorts first
    grown = grow([*sources, delta], store, manifest_uri(store, first), SPLIT)
    full = build([*sources, delta], tmp_path / "full", SPLIT)
    differ = []
    for split in SPLITS:
        ours, theirs = _rows(store, grown, split), _rows(tmp_path / "full", full, split)
        assert ours["text"].equals(theirs["text"]), split
        pairs = zip(ours.to_pylist(), theirs.to_pylist(), strict=True)
        differ += [(a, b) for a, b in pairs if a != b]
    assert len(differ) >= 15  # the delta's copies of the base's texts: 10 exact, 5 another reviewer's
    assert all(a["category"] == "Gift_Cards" and b["category"] == "AA_Gift_Cards" for a, b in differ)


def test_nothing_new_is_the_base_itself(base: tuple[Path, list[Path], Manifest], tmp_path: Path) -> None:
    root, sources, first = base
    store = _grown_store(root, first, tmp_path)
    assert grow(sources, store, "newest", SPLIT) == first
    assert sorted(p.name for p in (store / "corpora").iterdir()) == [first.corpus_id]


@pytest.mark.parametrize("change", ["removed", "changed", "split", "no key index"])
def test_a_delta_that_would_not_only_add_is_refused_before_any_work(
    change: str, base: tuple[Path, list[Path], Manifest], tmp_path: Path
) -> None:
    root, sources, first = base
    store = _grown_store(root, first, tmp_path)
    gift_cards = next(s for s in sources if s.name.startswith("Gift"))
    given, config = [*sources, _delta_file(tmp_path / "new", "zz_Gift_Cards_5.json", gift_cards, 2)], SPLIT
    message = {
        "removed": f"source {gift_cards.name} \\({gift_cards}\\) of corpus {first.corpus_id} is not among",
        "changed": f"source {gift_cards.name} changed since corpus {first.corpus_id} was built",
        "split": f"corpus {first.corpus_id} is split 6:2:2; a delta keeps its base's split",
        "no key index": f"corpus {first.corpus_id} has no key index",
    }[change]
    if change == "removed":
        given.remove(gift_cards)
    elif change == "changed":
        moved = tmp_path / "edited" / gift_cards.name
        moved.parent.mkdir()
        moved.write_bytes(gzip.compress(gzip.decompress(gift_cards.read_bytes())[:-200]))
        given[given.index(gift_cards)] = moved
    elif change == "split":
        config = CorpusConfig(split=(8, 1, 1))
    else:
        path = store / "corpora" / first.corpus_id / "manifest.json"
        saved = json.loads(path.read_text())
        del saved["keys"]  # as a manifest written before deltas
        path.write_text(json.dumps(saved))
    with pytest.raises(DeltaRefused, match=message) as refused:
        grow(given, store, manifest_uri(store, first), config)
    assert "\n" not in str(refused.value)
    assert sorted(p.name for p in (store / "corpora").iterdir()) == [first.corpus_id]  # no work done


def test_two_deltas_on_one_base_at_once_the_second_is_told(
    base: tuple[Path, list[Path], Manifest], tmp_path: Path
) -> None:
    root, sources, first = base
    store = _grown_store(root, first, tmp_path)
    gift_cards = next(s for s in sources if s.name.startswith("Gift"))
    delta = _delta_file(tmp_path / "new", "zz_Gift_Cards_5.json", gift_cards, 2)
    lock = store / "corpora" / first.corpus_id / "_delta_lock.json"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the other delta
    try:
        record = {"host": socket.gethostname(), "pid": alive.pid, "started_at": time.time()}
        lock.write_text(json.dumps({**record, "refreshed_at": time.time()}))
        with pytest.raises(
            BuildInProgress,
            match=f"corpus {first.corpus_id} is being grown by a delta by process {alive.pid}",
        ):
            grow([*sources, delta], store, manifest_uri(store, first), SPLIT)
        assert sorted(p.name for p in (store / "corpora").iterdir()) == [first.corpus_id]
    finally:
        alive.kill()
        alive.wait()
    grown = grow([*sources, delta], store, manifest_uri(store, first), SPLIT)  # that one is gone
    assert grown.parent is not None and not lock.exists()


def test_newest_is_the_latest_published_and_a_child_over_its_parent_in_the_same_second(
    base: tuple[Path, list[Path], Manifest], tmp_path: Path
) -> None:
    root, sources, first = base
    store = _grown_store(root, first, tmp_path)
    assert newest_manifest(LocalStore(store)) == manifest_uri(store, first)
    gift_cards = next(s for s in sources if s.name.startswith("Gift"))
    grown = grow(
        [*sources, _delta_file(tmp_path / "new", "zz_Gift_Cards_5.json", gift_cards, 2)],
        store,
        "newest",
        SPLIT,
    )
    assert grown.parent is not None and grown.parent.corpus_id == first.corpus_id  # newest was the base
    path = corpus_dir(store, grown) / "manifest.json"
    path.write_bytes(grown.model_copy(update={"created_at": first.created_at}).to_json())
    assert newest_manifest(LocalStore(store)) == str(path)  # the same second: the child


def test_the_command_refuses_a_removed_source_in_one_line_and_shows_a_delta(
    base: tuple[Path, list[Path], Manifest], tmp_path: Path
) -> None:
    """``corpus build --base`` refuses before any flow run (so in this process, no Prefect API), and
    ``corpus show`` says what a grown corpus added to which corpus."""
    from conftest import cli_in_process

    root, sources, first = base
    store = _grown_store(root, first, tmp_path)
    gift_cards = next(s for s in sources if s.name.startswith("Gift"))
    delta = _delta_file(tmp_path / "new", "zz_Gift_Cards_5.json", gift_cards, 2)
    given = [str(s) for s in [*sources, delta] if s != gift_cards]
    env: dict[str, str | None] = {"MLSTM_HOME": str(tmp_path / "home"), "MLSTM_STORE_URI": str(store)}
    refused = cli_in_process(["corpus", "build", *given, "--split", "6:2:2", "--base", "newest"], env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert f"source {gift_cards.name}" in refused.stderr and "is not among the SOURCES" in refused.stderr

    grown = grow([*sources, delta], store, "newest", SPLIT)
    assert grown.delta is not None
    shown = cli_in_process(["corpus", "show", manifest_uri(store, grown)], env)
    said = f"delta of {grown.delta.totals.kept:,} rows on corpus {first.corpus_id} ({delta.name})"
    assert shown.returncode == 0 and said in shown.stdout


def test_a_key_is_held_by_the_base_only_where_both_its_halves_match() -> None:
    """The base's keys sorted by (hi, lo), some his shared by several keys (rare for 128-bit keys, so
    built here): each delta key is held exactly where the base has the same pair, against a set."""
    rng = np.random.default_rng(0)
    shared_hi = rng.integers(0, 2**63, 50, dtype=np.uint64)
    base = {(int(h), int(rng.integers(0, 2**63))) for h in rng.integers(0, 2**63, 2000, dtype=np.uint64)}
    base |= {(int(h), int(rng.integers(0, 2**63))) for h in shared_hi for _ in range(3)}  # runs of one hi
    pairs = np.array(sorted(base), dtype=np.uint64)
    asked = [p for i, p in enumerate(sorted(base)) if i % 3 == 0]  # held, single and in runs
    asked += [(h, lo + 1) for h, lo in sorted(base)[1::7]]  # a base hi, another lo: not held
    asked += [(int(h), 5) for h in rng.integers(0, 2**63, 300, dtype=np.uint64)]  # unknown hi
    hi, lo = (np.array([p[i] for p in asked], dtype=np.uint64) for i in (0, 1))
    held = keyindex._members(hi, lo, pairs[:, 0].copy(), pairs[:, 1].copy())
    assert held.tolist() == [p in base for p in asked]
    assert held.any() and not held.all()
