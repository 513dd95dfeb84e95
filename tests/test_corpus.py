"""The corpus contract on the real Amazon files and on hand-made bad input (plain functions)."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import xxhash
from corpus_helpers import build, corpus_dir, read_split, rejected, saved_manifest, shard_digests

from models.text import clean_text
from tasks.corpus.build import SPLITS, CorpusConfig, plan_corpus
from tasks.corpus.keys import split_of, text_keys
from tasks.corpus.manifest import Manifest
from tasks.corpus.reviews import CORPUS_SCHEMA
from tasks.corpus.sample import write_sample
from tasks.corpus.sources import SourceError

SMALL_SPLIT = CorpusConfig(split=(98, 1, 1))


def _count_lines(path: Path) -> int:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as stream:
        return sum(1 for line in stream if line.strip())


@pytest.fixture(scope="module")
def real_corpus(amazon_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    store = tmp_path_factory.mktemp("store")
    return store, build([amazon_dir], store, SMALL_SPLIT)


def test_manifest_counts_every_record_of_every_real_file(
    real_corpus: tuple[Path, Manifest], amazon_dir: Path
) -> None:
    store, manifest = real_corpus
    assert saved_manifest(store, manifest) == manifest
    files = sorted(amazon_dir.rglob("*.gz"))
    assert len(manifest.sources) == len(files) == 11
    for source in manifest.sources:
        path = Path(source.uri)
        assert source.records == _count_lines(path), source.name
        assert source.records == source.kept + source.duplicates + source.rejected
        assert source.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    by_name = {Path(s.uri).relative_to(amazon_dir).as_posix(): s for s in manifest.sources}
    # Facts from the data's README: reviews without reviewText, and repeated records.
    assert by_name["AMAZON_FASHION_5.json.gz"].rejected == 16
    assert by_name["Gift_Cards_5.json.gz"].rejected == 6
    assert by_name["reviews_Musical_Instruments_5.json.gz"].rejected == 7  # empty reviewText
    assert by_name["Appliances_5.json.gz"].duplicates >= 2074  # repeats of earlier records
    totals = manifest.totals
    assert totals.kept == sum(manifest.splits[s].rows for s in SPLITS)
    assert totals.records == 42546 + 7853  # complete files + partial slices


def test_shards_hold_what_the_manifest_says(real_corpus: tuple[Path, Manifest]) -> None:
    store, manifest = real_corpus
    base = corpus_dir(store, manifest)
    for split in SPLITS:
        info = manifest.splits[split]
        assert info.rows == sum(s.rows for s in info.shards) > 0
        for shard in info.shards:
            data = (base / shard.path).read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard.sha256
            assert len(data) == shard.bytes
            table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
            assert table.schema == CORPUS_SCHEMA
            assert table.num_rows == shard.rows
            assert sum(len(t.encode()) for t in table["text"].to_pylist()) == shard.text_bytes


def test_texts_are_clean_unique_and_split_by_their_key(real_corpus: tuple[Path, Manifest]) -> None:
    store, manifest = real_corpus
    seen: set[str] = set()
    for index, split in enumerate(SPLITS):
        table = read_split(store, manifest, split)
        texts = table["text"].to_pylist()
        assert all(t.startswith("\n ") and t.endswith(" ") and t.strip() for t in texts)
        assert not seen.intersection(texts), "a text appears twice in the corpus"
        seen.update(texts)
        _, lo = text_keys(table["text"].combine_chunks())
        assert (split_of(lo, CorpusConfig(split=(98, 1, 1)).fractions) == index).all()
    # 98:1:1 of ~39k unique reviews puts a few hundred in each held-out split.
    assert 200 < manifest.splits["val"].rows < 600


def test_metadata_columns_are_read_from_all_three_releases(real_corpus: tuple[Path, Manifest]) -> None:
    store, manifest = real_corpus
    table = read_split(store, manifest, "train")
    rows = {r["category"]: r for r in table.to_pylist()}
    assert {"Musical_Instruments", "Subscription_Boxes", "AMAZON_FASHION", "Movies_and_TV"} <= rows.keys()
    for row in rows.values():
        assert 1.0 <= row["rating"] <= 5.0
        assert row["product_id"] and row["reviewer_id"]
        assert 2000 <= row["time"].year <= 2024
    assert table["verified"].null_count < table.num_rows
    assert pa.compute.max(table["helpful_votes"]).as_py() > 100


def test_same_sources_give_the_same_bytes_however_the_work_is_cut(amazon_dir: Path, tmp_path: Path) -> None:
    # Plain copies of two files, so they are split into many pieces when piece_mb is small.
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("reviews_Musical_Instruments_5.json.gz", "Subscription_Boxes.jsonl.gz"):
        (plain / name.removesuffix(".gz")).write_bytes(gzip.decompress((amazon_dir / name).read_bytes()))
    one = build([plain], tmp_path / "a", SMALL_SPLIT)
    pieces = plan_corpus([str(plain)], SMALL_SPLIT.model_copy(update={"piece_mb": 1, "block_mb": 1})).pieces
    assert len(pieces) >= 12
    two = build([plain], tmp_path / "b", SMALL_SPLIT.model_copy(update={"piece_mb": 1, "block_mb": 1}))
    assert one.corpus_id == two.corpus_id
    assert shard_digests(tmp_path / "a", one) == shard_digests(tmp_path / "b", two)
    assert [s.records for s in one.sources] == [s.records for s in two.sources]
    # A different split is a different corpus.
    three = plan_corpus([str(plain)], CorpusConfig(split=(8, 1, 1)))
    assert three.corpus_id != one.corpus_id


def test_a_piece_stopped_between_blocks_leaves_no_marker_and_is_parsed_whole_again(
    amazon_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``parse_piece`` calls ``on_block`` before each block: the flow's stop (``flows.stopping``) raises
    there, and a piece stopped so has no completion marker, so the rerun parses it whole."""
    import tasks.corpus.sources
    from tasks.corpus.build import parse_piece
    from tasks.store import LocalStore

    monkeypatch.setattr(tasks.corpus.sources, "READ_CHUNK", 2**20)  # blocks of 1 MB: seven of them
    gzipped = (amazon_dir / "reviews_Musical_Instruments_5.json.gz").read_bytes()
    (plain := tmp_path / "reviews.json").write_bytes(gzip.decompress(gzipped))
    plan = plan_corpus([str(plain)], SMALL_SPLIT.model_copy(update={"block_mb": 1}))
    (piece,) = plan.pieces
    store = LocalStore(tmp_path / "store")
    blocks: list[int] = []

    class Stop(Exception):
        pass

    def stop_at_the_third() -> None:
        blocks.append(1)
        if len(blocks) == 3:
            raise Stop

    with pytest.raises(Stop):
        parse_piece(plan, piece, store, on_block=stop_at_the_third)
    assert not store.exists(plan.work_key("map", piece.piece_id, "_SUCCESS.json"))
    result = parse_piece(plan, piece, store)
    assert store.exists(plan.work_key("map", piece.piece_id, "_SUCCESS.json"))
    assert result.bytes_read == plain.stat().st_size and result.records == _count_lines(plain)


def test_a_bucket_not_begun_when_the_flow_stops_writes_nothing_and_is_reduced_on_the_rerun(
    amazon_dir: Path, tmp_path: Path
) -> None:
    """The flow's reduce task checks the flow's stop (``flows.stopping``) before it reads: after Ctrl-C a
    build on threads reduces no more buckets, and those it did not begin leave no marker or shard for
    the rerun to trust."""
    from flows.corpus import reduce_unless_stopped
    from flows.stopping import STOPPING, Stopped
    from tasks.corpus.build import bucket_inputs, parse_piece
    from tasks.store import LocalStore

    plan = plan_corpus([str(amazon_dir / "Gift_Cards_5.json.gz")], SMALL_SPLIT)
    store = LocalStore(tmp_path / "store")
    inputs = bucket_inputs([parse_piece(plan, piece, store) for piece in plan.pieces], plan.num_buckets)
    before = sorted(p for p in (tmp_path / "store").rglob("*") if p.is_file())
    STOPPING.set()
    try:
        with pytest.raises(Stopped):
            reduce_unless_stopped(plan, 0, store, inputs[0])
    finally:
        STOPPING.clear()
    assert sorted(p for p in (tmp_path / "store").rglob("*") if p.is_file()) == before
    result = reduce_unless_stopped(plan, 0, store, inputs[0])
    assert store.exists(plan.work_key("reduce", "bucket-00000.json")) and sum(result.kept) > 0


def test_split_membership_does_not_change_when_sources_are_added(amazon_dir: Path, tmp_path: Path) -> None:
    first = [amazon_dir / "Gift_Cards_5.json.gz"]
    more = [*first, amazon_dir / "All_Beauty_5.json.gz", amazon_dir / "Subscription_Boxes.jsonl.gz"]
    small = build(first, tmp_path / "a", SMALL_SPLIT)
    large = build(more, tmp_path / "b", SMALL_SPLIT)
    where = {t: s for s in SPLITS for t in read_split(tmp_path / "b", large, s)["text"].to_pylist()}
    for split in SPLITS:
        for text in read_split(tmp_path / "a", small, split)["text"].to_pylist():
            assert where[text] == split


def test_second_plan_of_the_same_sources_is_the_same_corpus(amazon_dir: Path, tmp_path: Path) -> None:
    sources = [str(amazon_dir / "Gift_Cards_5.json.gz")]
    cache = tmp_path / "fingerprints.json"
    first = plan_corpus(sources, SMALL_SPLIT, cache_path=cache)
    assert cache.exists()
    assert plan_corpus(sources, SMALL_SPLIT, cache_path=cache) == first


def test_a_corpus_task_s_arguments_do_not_grow_with_the_plan() -> None:
    """Each parse task took the whole plan (every piece, each carrying every piece's start) and each
    reduce task every piece's result with every bucket it wrote: O(N²) for Prefect to walk (a 40 GB
    plain file: 56 ms a parse task, 1.3 s a reduce task). A parse task now takes the plan without its
    pieces and its own piece; a reduce task the ids of the pieces that wrote its bucket."""
    import pickle

    from tasks.corpus.build import CorpusPlan, PieceResult, bucket_inputs
    from tasks.corpus.sources import Source, pieces_of

    def plan_of(gib: int) -> CorpusPlan:
        piece = 64 * 2**20
        source = Source(
            uri="big.json", name="big.json", size=gib * 2**30, sha256="0" * 64, gzip=False,
            piece_starts=tuple((i * piece, 1 + i * 40_000) for i in range(gib * 2**30 // piece)),
        )  # fmt: skip
        return CorpusPlan(
            corpus_id="c", prefix="corpora/c", config=CorpusConfig(), sources=(source,),
            pieces=tuple(pieces_of(0, source)), num_buckets=gib * 8,
        )  # fmt: skip

    def parse_bytes(plan: CorpusPlan) -> int:
        return max(len(pickle.dumps((plan.for_tasks(), piece))) for piece in plan.pieces[::7])

    small, large = plan_of(1), plan_of(8)
    assert len(large.pieces) == 8 * len(small.pieces) == 128
    assert parse_bytes(large) < 1.1 * parse_bytes(small), (parse_bytes(small), parse_bytes(large))

    # Every piece wrote every bucket (keys are hashes): a bucket's task holds its own inputs only.
    def reduce_bytes(num_buckets: int) -> int:
        results = [PieceResult(p.piece_id, 0, buckets=list(range(num_buckets))) for p in large.pieces]
        inputs = bucket_inputs(reversed(results), num_buckets)
        assert inputs[num_buckets - 1] == tuple(p.piece_id for p in large.pieces)  # in (source, line) order
        return len(pickle.dumps((large.for_tasks(), num_buckets - 1, inputs[num_buckets - 1])))

    assert reduce_bytes(512) < 1.1 * reduce_bytes(8), (reduce_bytes(8), reduce_bytes(512))


# ------------------------------------------------------------------------------------------------
# Bad input never stops the corpus and never loses data

GOOD = {
    "reviewerID": "A1",
    "asin": "B1",
    "reviewText": "Works great",
    "overall": 5.0,
    "summary": "ok",
    "unixReviewTime": 1,
}


def _line(**changes: object) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


BAD_LINES: list[tuple[bytes, str | None]] = [
    (_line(reviewText="first good review"), None),
    (b'{"reviewerID": "A2", "reviewText": "cut', "not JSON"),
    (b'{"reviewerID": "A1", "asin": "B1", "reviewText": "caf\xe9 latin-1"}', "undecodable bytes"),
    (json.dumps({"reviewerID": "A3", "asin": "B3", "overall": 1.0}).encode(), "no review text"),
    (_line(reviewText="   "), "empty review text"),
    (repr({**GOOD, "reviewText": "a loose python-literal dump"}).encode(), None),
    (b"[1, 2, 3]", "not a JSON object"),
    (b"", None),  # a blank line is not a record
    (_line(reviewText="windows line end") + b"\r", None),
    (_line(reviewText="vote with commas", vote="1,024"), None),
    (_line(reviewText="last good review"), None),
]


def test_bad_lines_are_rejected_with_file_line_and_reason(tmp_path: Path) -> None:
    source = tmp_path / "raw" / "Bad_Things_5.json"
    source.parent.mkdir()
    source.write_bytes(b"\n".join(line for line, _ in BAD_LINES) + b"\n")
    manifest = build([source], tmp_path / "store", SMALL_SPLIT)
    rows = rejected(tmp_path / "store", manifest)
    expected = [(i + 1, reason, line) for i, (line, reason) in enumerate(BAD_LINES) if reason]
    assert [(r["line"], r["raw"]) for r in rows] == [(line_no, line) for line_no, _, line in expected]
    for row, (_, reason, _) in zip(rows, expected, strict=True):
        assert row["reason"].startswith(reason), row
        assert row["source"] == str(source)
    kept = {t for s in SPLITS for t in read_split(tmp_path / "store", manifest, s)["text"].to_pylist()}
    assert kept == {
        clean_text(t)
        for t in (
            "first good review",
            "a loose python-literal dump",
            "windows line end",
            "vote with commas",
            "last good review",
        )
    }
    (entry,) = manifest.sources
    assert (entry.records, entry.kept, entry.rejected) == (10, 5, 5)
    votes = pa.concat_tables(read_split(tmp_path / "store", manifest, s) for s in SPLITS).to_pylist()
    assert {r["helpful_votes"] for r in votes if "commas" in r["text"]} == {1024}


def test_a_truncated_gzip_keeps_what_it_has_and_says_where_it_ends(amazon_dir: Path, tmp_path: Path) -> None:
    whole = (amazon_dir / "Gift_Cards_5.json.gz").read_bytes()
    cut = tmp_path / "raw" / "Gift_Cards_5.json.gz"
    cut.parent.mkdir()
    cut.write_bytes(whole[: len(whole) // 2])
    manifest = build([cut], tmp_path / "store", SMALL_SPLIT)
    (entry,) = manifest.sources
    rows = rejected(tmp_path / "store", manifest)
    damage = [r for r in rows if r["reason"].startswith("truncated gzip")]
    assert len(damage) == 1
    assert damage[0]["line"] == entry.records  # the last line read is the cut one
    assert entry.records == entry.kept + entry.duplicates + entry.rejected
    assert 1000 < entry.kept + entry.duplicates < 2972  # about half of the file's reviews


def test_corrupt_gzip_data_is_reported(amazon_dir: Path, tmp_path: Path) -> None:
    data = bytearray((amazon_dir / "Gift_Cards_5.json.gz").read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    bad = tmp_path / "raw" / "Gift_Cards_5.json.gz"
    bad.parent.mkdir()
    bad.write_bytes(bytes(data))
    manifest = build([bad], tmp_path / "store", SMALL_SPLIT)
    reasons = {r["reason"].split(" (")[0] for r in rejected(tmp_path / "store", manifest)}
    assert "corrupt gzip data" in reasons
    assert manifest.sources[0].kept > 500


def test_multi_member_gzip_and_misnamed_files_read_whole(amazon_dir: Path, tmp_path: Path) -> None:
    first = (amazon_dir / "Gift_Cards_5.json.gz").read_bytes()
    second = (amazon_dir / "Appliances_5.json.gz").read_bytes()
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "Both_5.json.gz").write_bytes(first + second)
    # Gzip is recognised by its bytes, not its name.
    (raw / "Misnamed_5.json").write_bytes(second)
    manifest = build([raw], tmp_path / "store", SMALL_SPLIT)
    records = {s.name: s.records for s in manifest.sources}
    assert records == {"Both_5.json.gz": 2972 + 2277, "Misnamed_5.json": 2277}


def test_line_numbers_are_right_deep_inside_a_split_plain_file(amazon_dir: Path, tmp_path: Path) -> None:
    lines = gzip.decompress((amazon_dir / "reviews_Musical_Instruments_5.json.gz").read_bytes()).split(b"\n")
    lines[9000] = b"{broken"
    source = tmp_path / "Musical_Instruments_5.json"
    source.write_bytes(b"\n".join(lines))
    config = SMALL_SPLIT.model_copy(update={"piece_mb": 1, "block_mb": 1})
    assert len(plan_corpus([str(source)], config).pieces) >= 6
    manifest = build([source], tmp_path / "store", config)
    broken = [r for r in rejected(tmp_path / "store", manifest) if r["raw"] == b"{broken"]
    assert [r["line"] for r in broken] == [9001]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/reviews.json.gz"], "/no/such/reviews.json.gz': no such file"),
        (["/no/such/dir/*.json.gz"], "the glob matches no file"),
        ([], "no SOURCE given"),
    ],
)
def test_unusable_sources_fail_before_any_work(args: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=message.replace("*", r"\*").replace(".", r"\.")):
        build(args, tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_a_folder_without_review_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not reviews")
    with pytest.raises(SourceError, match="holds no review files"):
        plan_corpus([str(tmp_path)], CorpusConfig())


def test_config_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match=r"split\n.*'1000:1': write three whole numbers"):
        CorpusConfig(split="1000:1")  # type: ignore[arg-type]  # the flag's text, parsed by the model
    assert CorpusConfig(split="98:1:1").split == (98, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split"):
        CorpusConfig(split=(0, 1, 1))


def test_keys_are_xxh3_128_of_the_utf8_text() -> None:
    texts = ["\n a ", "\n é ", ""]
    hi, lo = text_keys(pa.array(texts, pa.large_string()))
    for text, h, low in zip(texts, hi.tolist(), lo.tolist(), strict=True):
        assert (h << 64) | low == xxhash.xxh3_128_intdigest(text.encode())
    assert np.all(split_of(np.array([0, 2**64 - 1], dtype=np.uint64), (0.5, 0.25, 0.25)) == [0, 2])


def test_the_work_folder_is_gone_after_publishing(real_corpus: tuple[Path, Manifest]) -> None:
    store, manifest = real_corpus
    assert not (corpus_dir(store, manifest) / "_work").exists()
    assert sorted(p.name for p in corpus_dir(store, manifest).iterdir()) == [
        "keys",
        "manifest.json",
        "rejected",
        "test",
        "train",
        "val",
    ]


def test_copying_a_source_elsewhere_keeps_the_corpus_id(amazon_dir: Path, tmp_path: Path) -> None:
    shutil.copy(amazon_dir / "Gift_Cards_5.json.gz", tmp_path / "Gift_Cards_5.json.gz")
    here = plan_corpus([str(tmp_path / "Gift_Cards_5.json.gz")], SMALL_SPLIT)
    there = plan_corpus([str(amazon_dir / "Gift_Cards_5.json.gz")], SMALL_SPLIT)
    assert here.corpus_id == there.corpus_id


@pytest.mark.parametrize(
    ("content", "rejected_count"),
    [
        (b"", 0),  # an empty file
        (b'{"title": "a book", "price": 3}\n{"asin": "B00"}\n', 2),  # another schema
        (b"\xff\xfe\x00bad\n\xc3\x28\n", 2),  # not UTF-8
    ],
)
def test_sources_yielding_no_row_publish_nothing(content: bytes, rejected_count: int, tmp_path: Path) -> None:
    """Guards: a corpus of 0 rows is an error naming the source, the rejected count and the quarantine."""
    source = tmp_path / "raw" / "Nothing_5.json"
    source.parent.mkdir()
    source.write_bytes(content)
    with pytest.raises(SourceError) as raised:
        build([source], tmp_path / "store", SMALL_SPLIT)
    message = str(raised.value)
    assert str(source) in message and f"{rejected_count} rejected" in message, message
    assert ("rejected lines are in" in message) == bool(rejected_count), message
    assert not list((tmp_path / "store").rglob("manifest.json"))
    assert not list((tmp_path / "store").rglob("_work"))


def test_the_first_copy_in_source_and_line_order_is_the_one_kept(tmp_path: Path) -> None:
    """docs/corpus.md: duplicates go by the cleaned text; the record kept is the first in (source URI,
    line) order, with its own metadata, and every other copy is counted as a duplicate of its source."""

    def review(text: str, asin: str) -> bytes:
        return json.dumps({"reviewText": text, "overall": 5.0, "asin": asin, "reviewerID": "R"}).encode()

    raw = tmp_path / "raw"
    raw.mkdir()
    # b's copy comes first in its file, a's last in its: the source URI decides before the line does.
    (raw / "b_5.json").write_bytes(
        b"\n".join([review("Same words.", "b1"), review("Only in b.", "b2")]) + b"\n"
    )
    lines = [review("Only in a.", "a1"), review("Same words.", "a2"), review("  Same words. ", "a3")]
    (raw / "a_5.json").write_bytes(b"\n".join(lines) + b"\n")
    manifest = build([raw / "b_5.json", raw / "a_5.json"], tmp_path / "store", SMALL_SPLIT)
    rows = pa.concat_tables(read_split(tmp_path / "store", manifest, s) for s in SPLITS).to_pylist()
    same = [r["product_id"] for r in rows if r["text"] == clean_text("Same words.")]
    assert same == ["a2"]  # a_5.json line 2: before its own line 3 (same cleaned text) and before b
    counts = {Path(s.uri).name: (s.kept, s.duplicates) for s in manifest.sources}
    assert counts == {"a_5.json": (2, 1), "b_5.json": (1, 1)}


def test_invalid_utf8_inside_a_review_is_rejected_and_every_shard_validates(tmp_path: Path) -> None:
    """Guards: the JSON reader's fast path copies string bytes unchecked; a review holding raw bytes that
    are not UTF-8 (tight or spaced) or a JSON-escaped lone surrogate is rejected with its line, the rest
    kept, and every published shard passes pyarrow's full validation. The surrogate has a file of its
    own: the fast reader refuses it, which would send its neighbours down the line-by-line path too."""

    def review(text: bytes) -> bytes:
        return b'{"reviewText": "' + text + b'", "overall": 4.0, "asin": "B1", "reviewerID": "R"}'

    raw = tmp_path / "raw"
    raw.mkdir()
    lines = [
        review(b"fine words here"),
        review(b"bad bytes\xff\xfeinside"),
        review(b"bad bytes \xff \xfe spaced"),
    ]
    (raw / "Bytes_5.json").write_bytes(b"\n".join(lines) + b"\n")
    lines = [review(b"an escaped lone surrogate \\udcff here"), review(b"more fine words")]
    (raw / "Escapes_5.json").write_bytes(b"\n".join(lines) + b"\n")
    manifest = build([raw / "Bytes_5.json", raw / "Escapes_5.json"], tmp_path / "store", SMALL_SPLIT)
    rows = rejected(tmp_path / "store", manifest)
    assert [(Path(r["source"]).name, r["line"], r["reason"].split(":")[0]) for r in rows] == [
        ("Bytes_5.json", 2, "undecodable bytes"),
        ("Bytes_5.json", 3, "undecodable bytes"),
        ("Escapes_5.json", 1, "undecodable text"),
    ]
    kept = [t for s in SPLITS for t in read_split(tmp_path / "store", manifest, s)["text"].to_pylist()]
    assert sorted(kept) == sorted(clean_text(t) for t in ("fine words here", "more fine words"))
    for split in SPLITS:
        for shard in manifest.splits[split].shards:
            pa.ipc.open_file(corpus_dir(tmp_path / "store", manifest) / shard.path).read_all().validate(
                full=True
            )


def test_one_build_of_a_corpus_at_a_time_and_a_dead_builds_lock_is_taken_over(tmp_path: Path) -> None:
    """Guards: a second build of the same corpus into one store, while the first runs, is refused naming
    the first (and touches nothing); a lock left by a killed build is taken over and the build finishes."""
    import socket
    import subprocess
    import sys
    import time

    from tasks.corpus.lock import BuildInProgress

    sources = write_sample(tmp_path / "raw", num_reviews=60)
    plan = plan_corpus([str(s) for s in sources], SMALL_SPLIT)
    lock = tmp_path / "store" / plan.prefix / "_lock.json"
    lock.parent.mkdir(parents=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"host": socket.gethostname(), "pid": alive.pid, "started_at": time.time()}
        lock.write_text(json.dumps({**record, "refreshed_at": time.time()}))
        with pytest.raises(BuildInProgress, match=f"being built by process {alive.pid} on "):
            build(sources, tmp_path / "store", SMALL_SPLIT)
        assert sorted(p.name for p in lock.parent.iterdir()) == ["_lock.json"]  # nothing of its own
    finally:
        alive.kill()
        alive.wait()
    manifest = build(sources, tmp_path / "store", SMALL_SPLIT)  # the holder is gone: taken over
    assert manifest.corpus_id == plan.corpus_id and not lock.exists()
    assert not (lock.parent / "_work").exists()


def test_a_manifest_written_before_the_model_reads_and_writes_back_byte_for_byte(tmp_path: Path) -> None:
    """The model is the JSON on disk: an old manifest reads by attribute and dumps to the same bytes."""
    from tasks.corpus.manifest import read_manifest
    from tasks.store import LocalStore

    old = (Path(__file__).parent / "data" / "corpus-manifest-v1.json").read_bytes()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "manifest.json").write_bytes(old)
    manifest = read_manifest(LocalStore(tmp_path), "m/manifest.json")
    assert manifest.corpus_id == "477998ba3583113d" and manifest.totals.kept == 37
    assert manifest.columns["text"] == "large_string" and manifest.config.split == (8, 1, 1)
    assert manifest.to_json() == old


def test_a_json_file_that_is_not_a_manifest_is_refused_naming_the_field(tmp_path: Path) -> None:
    from tasks.corpus.manifest import ManifestError, read_manifest
    from tasks.store import LocalStore

    data = json.loads((Path(__file__).parent / "data" / "corpus-manifest-v1.json").read_text())
    data["totals"]["kept"] = "many"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"is not a corpus manifest: totals\.kept"):
        read_manifest(LocalStore(tmp_path), "manifest.json")
