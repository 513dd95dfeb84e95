"""The labelled datasets of the transfer stage: SST-2 and IMDB in every form they ship in, user tables, errors."""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import random
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tasks.transfer.datasets import Dataset, DatasetError, load_dataset, read_table

# (id, rating, label, text) rows of an IMDB CSV export.
ImdbRows = list[tuple[int, int, int, str]]


def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    data = buffer.getvalue().encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    data = "".join(json.dumps(record) + "\n" for record in records).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def read_imdb_rows(path: Path) -> ImdbRows:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as stream:
        reader = csv.reader(stream)
        next(reader)
        return [(int(i), int(r), int(label), text) for i, r, label, text in reader]


def bucket(text: str) -> int:
    """The documented split rule, written out independently of the module."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % 10


def reviews(num: int, *, seed: int = 0) -> list[tuple[str, int]]:
    """Distinct (text, label) pairs, both labels, texts with commas, quotes and newlines."""
    rng = random.Random(seed)
    words = [
        "great",
        "awful",
        "plot",
        "acting",
        "boring",
        "superb",
        'a "quoted" word',
        "so, so",
        "line\nbreak",
    ]
    return [(f"review {i}: " + " ".join(rng.choices(words, k=6)), i % 2) for i in range(num)]


# --- SST-2 --------------------------------------------------------------------------------------------------


def test_sst2_radford_splits(shared_data: Path) -> None:
    sst = load_dataset(str(shared_data / "sst2"))

    assert (sst.name, sst.kind, sst.dev_from_train) == ("sst2", "sst2-csv", None)
    assert [len(split) for split in sst.splits().values()] == [6920, 872, 1821]
    assert [int(split.labels.sum()) for split in sst.splits().values()] == [3610, 444, 909]
    assert sst.train.labels.dtype == np.int64
    assert (sst.dev.texts[0], sst.dev.labels[0]) == ("One long string of cliches.", 0)
    # Quoted fields keep their commas and are not cleaned.
    assert sst.dev.texts[1].startswith("If you've ever entertained the notion of doing what the title")
    assert sst.checksum == load_dataset(str(shared_data / "sst2")).checksum


def test_sst2_nvidia_names_give_the_same_data(shared_data: Path, tmp_path: Path) -> None:
    for radford, nvidia in [("train", "train"), ("dev", "val"), ("test", "test")]:
        shutil.copy(shared_data / "sst2" / f"{radford}_binary_sent.csv", tmp_path / f"{nvidia}.csv")

    nvidia = load_dataset(f"binary_sst={tmp_path}")

    assert (nvidia.name, nvidia.kind, nvidia.source) == ("binary_sst", "sst2-csv", str(tmp_path))
    assert nvidia.checksum == load_dataset(str(shared_data / "sst2")).checksum


def test_fixed_layout_refuses_other_columns(shared_data: Path) -> None:
    with pytest.raises(DatasetError, match="text_column='review' applies only to table data"):
        load_dataset(str(shared_data / "sst2"), text_column="review")
    # Naming the layout's own columns is harmless.
    assert load_dataset(str(shared_data / "sst2"), text_column="sentence").kind == "sst2-csv"


# --- IMDB ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imdb_rows(shared_data: Path) -> dict[str, ImdbRows]:
    return {split: read_imdb_rows(shared_data / "imdb" / f"{split}.csv.gz") for split in ("train", "test")}


@pytest.fixture(scope="module")
def imdb(shared_data: Path) -> Dataset:
    return load_dataset(str(shared_data / "imdb"))


def test_imdb_csv_export(imdb: Dataset) -> None:
    assert (imdb.name, imdb.kind) == ("imdb", "imdb-csv")
    assert [len(split) for split in imdb.splits().values()] == [22500, 2500, 25000]
    assert [int(split.labels.sum()) for split in imdb.splits().values()] == [11250, 1250, 12500]
    assert imdb.dev_from_train is not None and "id % 10 == 9" in imdb.dev_from_train


def test_imdb_dev_is_the_train_ids_ending_in_9(imdb: Dataset, imdb_rows: dict[str, ImdbRows]) -> None:
    ordered = sorted(imdb_rows["train"], key=lambda row: (row[2], row[0]))
    dev_ids = [(label, i) for i, _, label, _ in ordered if i % 10 == 9]
    train_ids = [(label, i) for i, _, label, _ in ordered if i % 10 != 9]

    assert not set(dev_ids) & set(train_ids)
    assert imdb.dev.texts == [text for i, _, _, text in ordered if i % 10 == 9]
    assert imdb.dev.labels.tolist() == [label for label, _ in dev_ids]
    assert imdb.train.texts == [text for i, _, _, text in ordered if i % 10 != 9]
    assert imdb.test.texts == [row[3] for row in sorted(imdb_rows["test"], key=lambda row: (row[2], row[0]))]


@pytest.fixture(scope="module")
def small_imdb(imdb_rows: dict[str, ImdbRows], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The first 40 reviews of each label and split as an aclImdb tree, its tarball and a CSV export,
    each written in a shuffled order (the readers must restore the canonical one)."""
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("small-imdb")
    rows: dict[str, ImdbRows] = {}
    for split, all_rows in imdb_rows.items():
        rows[split] = [r for r in all_rows if r[2] == 0][:40] + [r for r in all_rows if r[2] == 1][:40]
        rng.shuffle(rows[split])

    tree = root / "folder" / "aclImdb"
    for split, split_rows in rows.items():
        for review_id, rating, label, text in split_rows:
            review = tree / split / ("pos" if label else "neg") / f"{review_id}_{rating}.txt"
            review.parent.mkdir(parents=True, exist_ok=True)
            review.write_bytes(text.encode())
    # What the original tree holds beside the labelled reviews, none of which is a labelled review.
    (tree / "train" / "unsup").mkdir()
    (tree / "train" / "unsup" / "0_0.txt").write_text("An unlabelled review.")
    (tree / "train" / "urls_pos.txt").write_text("http://www.imdb.com/title/tt0453418/usercomments\n")
    (tree / "train" / "labeledBow.feat").write_text("9 0:9 1:1\n")
    (tree / "imdb.vocab").write_text("the\nand\n")

    tarball = root / "aclImdb_v1.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(tree, arcname="aclImdb")

    export = root / "export"
    export.mkdir()
    write_csv(export / "train.csv.gz", ["id", "rating", "label", "text"], [list(r) for r in rows["train"]])
    write_csv(export / "test.csv", ["id", "rating", "label", "text"], [list(r) for r in rows["test"]])
    return {"folder": tree.parent, "tarball": tarball, "export": export}


def test_imdb_folder_tarball_and_csv_export_are_the_same_data(
    small_imdb: dict[str, Path], imdb_rows: dict[str, ImdbRows]
) -> None:
    folder = load_dataset(str(small_imdb["folder"]))
    inner = load_dataset(str(small_imdb["folder"] / "aclImdb"))
    tarball = load_dataset(str(small_imdb["tarball"]))
    export = load_dataset(str(small_imdb["export"]))

    assert (folder.kind, inner.kind, tarball.kind, export.kind) == ("imdb-folder",) * 2 + (
        "imdb-tarball",
        "imdb-csv",
    )
    assert {d.name for d in (folder, inner, tarball, export)} == {"imdb"}
    # Ids 0-39 of each label: ids 9, 19, 29, 39 go to dev.
    assert [len(split) for split in folder.splits().values()] == [72, 8, 80]
    # Canonical order: negatives then positives, by numeric id (so 10 comes after 9).
    first_neg = sorted(r for r in imdb_rows["train"] if r[2] == 0 and r[0] < 40 and r[0] % 10 != 9)
    assert folder.train.texts[: len(first_neg)] == [r[3] for r in first_neg]
    for other in (inner, tarball, export):
        for name, split in folder.splits().items():
            assert other.splits()[name].texts == split.texts
            assert other.splits()[name].labels.tolist() == split.labels.tolist()
        assert other.checksum == folder.checksum


def test_truncated_tarball_is_named(small_imdb: dict[str, Path], tmp_path: Path) -> None:
    data = small_imdb["tarball"].read_bytes()
    truncated = tmp_path / "aclImdb_v1.tar.gz"
    truncated.write_bytes(data[: len(data) // 2])

    with pytest.raises(DatasetError, match=rf"{re.escape(str(truncated))}: truncated or corrupt tarball"):
        load_dataset(str(truncated))


def test_a_tarball_without_reviews_is_refused(tmp_path: Path) -> None:
    tarball = tmp_path / "other.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(write_csv(tmp_path / "train.csv", ["text", "label"], [["fine", 1]]), arcname="train.csv")

    with pytest.raises(DatasetError, match="no train/pos or train/neg reviews"):
        load_dataset(str(tarball))


# --- tables -------------------------------------------------------------------------------------------------


def test_table_folder_with_custom_columns(tmp_path: Path) -> None:
    rows = reviews(60)
    folder = tmp_path / "movies"
    folder.mkdir()
    for split, part in [("train", rows[:40]), ("val", rows[40:50]), ("test", rows[50:])]:
        write_csv(
            folder / f"{split}.csv",
            ["id", "review", "sentiment"],
            [[i, t, "pos" if y else "neg"] for i, (t, y) in enumerate(part)],
        )

    movies = load_dataset(str(folder), text_column="review", label_column="sentiment")

    assert (movies.name, movies.kind, movies.dev_from_train) == ("movies", "table", None)
    assert movies.train.texts == [t for t, _ in rows[:40]]
    assert movies.dev.labels.tolist() == [y for _, y in rows[40:50]]
    assert any("\n" in t and "," in t for t in movies.train.texts)


def test_table_folder_without_dev_takes_a_fixed_tenth_of_train(tmp_path: Path) -> None:
    rows = reviews(600)
    folder = tmp_path / "jsonl"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl.gz", [{"body": t, "positive": bool(y)} for t, y in rows[:500]])
    write_jsonl(folder / "test.json", [{"body": t, "positive": y} for t, y in rows[500:]])

    data = load_dataset(f"mine={folder}", text_column="body", label_column="positive")

    assert data.name == "mine" and data.dev_from_train is not None
    assert 25 <= len(data.dev) <= 75  # ~10% of 500
    assert data.dev.texts == [t for t, _ in rows[:500] if bucket(t) == 0]
    assert data.train.texts == [t for t, _ in rows[:500] if bucket(t) != 0]
    assert len(data.test) == 100
    assert data.checksum == load_dataset(str(folder), text_column="body", label_column="positive").checksum


def test_single_file_is_split_80_10_10_by_text(tmp_path: Path) -> None:
    rows = reviews(2000)
    # A repeated text must land in one split only.
    rows += [rows[0], rows[1], rows[2]]
    path = write_csv(tmp_path / "reviews.csv.gz", ["text", "label"], [[t, y] for t, y in rows])

    data = load_dataset(str(path))

    assert (data.name, data.kind) == ("reviews", "table")
    assert data.dev_from_train is not None and "80/10/10" in data.dev_from_train
    assert sum(len(s) for s in data.splits().values()) == len(rows)
    assert 0.75 < len(data.train) / len(rows) < 0.85
    assert data.dev.texts == [t for t, _ in rows if bucket(t) == 0]
    assert data.test.texts == [t for t, _ in rows if bucket(t) == 1]
    texts = {name: set(split.texts) for name, split in data.splits().items()}
    assert not (
        texts["train"] & texts["dev"] or texts["train"] & texts["test"] or texts["dev"] & texts["test"]
    )
    assert data.checksum == load_dataset(str(path)).checksum


@pytest.mark.parametrize(
    ("raw", "label"),
    [
        ("1", 1),
        ("0", 0),
        ("POS", 1),
        ("neg", 0),
        ("Positive", 1),
        (" negative ", 0),
        ("true", 1),
        ("False", 0),
    ],
)
def test_label_spellings(tmp_path: Path, raw: str, label: int) -> None:
    path = write_csv(tmp_path / "t.csv", ["text", "label"], [["some text", raw]])
    assert read_table(path, label_column="label")[1].tolist() == [label]


def test_read_table_keeps_file_order_and_needs_no_labels(tmp_path: Path) -> None:
    rows = reviews(30)
    path = write_jsonl(tmp_path / "unlabelled.jsonl", [{"text": t} for t, _ in rows])

    texts, labels = read_table(path)

    assert texts == [t for t, _ in rows] and labels is None


# --- errors -------------------------------------------------------------------------------------------------


def test_bad_label_names_file_line_and_value(tmp_path: Path) -> None:
    # The second row spans lines 3-4 (a quoted newline), so the bad row starts on line 5.
    path = write_csv(
        tmp_path / "train.csv", ["text", "label"], [["fine", 1], ["two\nlines", 0], ["meh", "maybe"]]
    )
    with pytest.raises(
        DatasetError, match=rf"{re.escape(str(path))}: line 5: 'label' is \"maybe\", not a sentiment label"
    ):
        read_table(path, label_column="label")


def test_star_ratings_are_not_labels(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "amazon.jsonl", [{"text": "fine", "overall": 1}, {"text": "great", "overall": 5.0}]
    )
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: line 2: 'overall' is 5.0"):
        read_table(path, label_column="overall")


def test_missing_column_lists_the_columns(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", ["review", "stars"], [["fine", 5]])
    with pytest.raises(
        DatasetError,
        match=rf"{re.escape(str(path))}: no column 'text' \(columns: review, stars\); name the right ones "
        "with --text-column / --label-column",
    ):
        read_table(path)
    jsonl = write_jsonl(tmp_path / "t.jsonl", [{"text": "ok", "label": 1}, {"text": "ok too"}])
    with pytest.raises(
        DatasetError,
        match=rf"{re.escape(str(jsonl))}: line 2: no field 'label' \(fields: text\); name the right ones "
        "with --text-column / --label-column",
    ):
        read_table(jsonl, label_column="label")


def test_empty_text_names_the_line(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", ["text", "label"], [["fine", 1], ["   ", 0]])
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: line 3: 'text' is empty"):
        read_table(path, label_column="label")


def test_bad_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "fine", "label": 1}\n\n{"text": "cut off\n')
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: line 3: bad JSON"):
        read_table(path, label_column="label")


def test_a_json_array_is_not_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text('[{"text": "fine", "label": 1}]\n')
    with pytest.raises(DatasetError, match="write one JSON object per line, not an array"):
        read_table(path, label_column="label")


@pytest.mark.parametrize(
    ("name", "data", "problem"),
    [("latin1.csv", "text\ncaf\xe9\n".encode("latin-1"), "not UTF-8"), ("t.csv.gz", b"plain", "cannot read")],
)
def test_unreadable_file_is_named(tmp_path: Path, name: str, data: bytes, problem: str) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: {problem}"):
        read_table(path)


def test_ragged_csv_row_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("text,label\nfine,1\nso, so,0\n")
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: line 3: 3 fields but the header has 2"):
        read_table(path, label_column="label")


def test_unknown_layout_lists_the_accepted_ones(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DatasetError, match="not a dataset layout") as error:
        load_dataset(str(tmp_path))
    for layout in ("SST-2 folder", "IMDB folder", "IMDB tarball", "IMDB CSV export", "table"):
        assert layout in str(error.value)
    with pytest.raises(DatasetError, match="not a dataset layout"):
        load_dataset(str(tmp_path / "notes.txt"))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(
        DatasetError, match=rf"{re.escape(str(tmp_path / 'nowhere'))}: no such file or folder"
    ):
        load_dataset(f"name={tmp_path / 'nowhere'}")


def test_table_folder_needs_a_test_file(tmp_path: Path) -> None:
    write_csv(tmp_path / "train.csv", ["text", "label"], [[t, y] for t, y in reviews(20)])
    with pytest.raises(DatasetError, match="needs a test file"):
        load_dataset(str(tmp_path))


def test_one_class_split_is_refused(tmp_path: Path) -> None:
    write_csv(tmp_path / "train.csv", ["text", "label"], [[t, y] for t, y in reviews(20)])
    write_csv(tmp_path / "dev.csv", ["text", "label"], [[t, y] for t, y in reviews(20, seed=1)])
    write_csv(tmp_path / "test.csv", ["text", "label"], [["good", 1], ["great", 1]])
    with pytest.raises(DatasetError, match=r"the test split has only positive labels .* needs both classes"):
        load_dataset(str(tmp_path))
