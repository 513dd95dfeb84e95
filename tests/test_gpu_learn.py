"""`make gpu-learn` (benchmarks/gpu_learn.py) on the CPU: the bundle benchmarks/pack_gpu_data.py packs,
read back by the same script a GPU runs, at the tiny preset for a few steps."""

from __future__ import annotations

import csv
import gzip
import io
import json
import random
from pathlib import Path

import pytest
from conftest import load_benchmark

WORDS = {0: ["awful", "boring", "dull", "bad"], 1: ["great", "lovely", "fine", "good"]}


def _review(rng: random.Random, label: int) -> str:
    return " ".join(rng.choice(WORDS[label] + ["film", "plot", "the"]) for _ in range(rng.randint(4, 12)))


def _csv(rows: list[dict[str, object]], header: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, header)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def shared_data(root: Path) -> Path:
    """A shared-data folder laid out as /work/shared/data, each file a few generated reviews."""
    rng = random.Random(0)
    (root / "amazon" / "partial").mkdir(parents=True)
    (root / "imdb").mkdir()
    (root / "sst2").mkdir()
    amazon = [json.dumps({"reviewText": _review(rng, i % 2), "overall": 5.0}) for i in range(60)]
    amazon += [amazon[0]]  # a duplicate, dropped
    (root / "amazon" / "Books_5.json.gz").write_bytes(gzip.compress("\n".join(amazon).encode()))
    newer = [json.dumps({"text": _review(rng, 1), "rating": 5}) for _ in range(20)]
    (root / "amazon" / "partial" / "Boxes.jsonl.gz").write_bytes(gzip.compress("\n".join(newer).encode()))
    labelled = {
        split: [
            {"id": i, "rating": 9 * (i % 2) + 1, "label": i % 2, "text": _review(rng, i % 2)}
            for i in range(40)
        ]
        for split in ("train", "test")
    }
    for split, rows in labelled.items():
        text = _csv(rows, ["id", "rating", "label", "text"])
        (root / "imdb" / f"{split}.csv.gz").write_bytes(gzip.compress(text.encode()))
    unsup = [{"id": i, "text": _review(rng, i % 2)} for i in range(80)]
    unsup.append({"id": 80, "text": labelled["test"][0]["text"]})  # a labelled test review: dropped
    (root / "imdb" / "unsup.csv.gz").write_bytes(gzip.compress(_csv(unsup, ["id", "text"]).encode()))
    for name, count in (("train", 40), ("dev", 16), ("test", 16)):
        rows = [{"label": i % 2, "sentence": _review(rng, i % 2)} for i in range(count)]
        (root / "sst2" / f"{name}_binary_sent.csv").write_text(_csv(rows, ["label", "sentence"]))
    return root


def test_the_learning_part_reads_its_packed_bundle_and_reports_each_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pack = load_benchmark("pack_gpu_data.py", "pack_gpu_data", monkeypatch)
    bundle = tmp_path / "bundle"
    argv = ["--shared", str(shared_data(tmp_path / "shared")), "--out", str(bundle)]
    assert pack.main([*argv, "--imdb-train", "20", "--imdb-test", "10", "--val-every", "5"]) == 0
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["reviews"] == {
        "amazon": 80,
        "imdb_unlabelled": 80,
        "duplicates": 1,
        "labelled_imdb_dropped": 1,
    }
    assert manifest["train_reviews"] + manifest["val_reviews"] == 160 and manifest["val_reviews"] > 0
    assert manifest["probes"] == {
        "sst": {"train": 40, "dev": 16, "test": 16},
        "imdb": {"train": 18, "dev": 2, "test": 10},
    }

    learn = load_benchmark("gpu_learn.py", "gpu_learn", monkeypatch)
    out = tmp_path / "learn.json"
    argv = ["--data", str(bundle), "--preset", "tiny", "--batch", "4", "--seq-len", "16", "--cpu"]
    argv += [
        "--max-steps",
        "6",
        "--points",
        "2",
        "--val-rows",
        "2",
        "--val-bytes",
        "4000",
        "--json",
        str(out),
    ]
    assert learn.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["steps"] == 6 and not report["captured"] and report["settings"]["precision"] == "fp32"
    points = report["points"]
    assert [p["step"] for p in points] == [0, 3, 6]
    assert [p["chars_seen"] for p in points] == [0, 3 * 4 * 16, 6 * 4 * 16]
    assert points[0]["train_loss"] is None and all(p["train_loss"] > 0 for p in points[1:])
    assert all(p["train_s"] > 0 for p in points[1:]) and points[1]["train_s"] <= points[2]["train_s"]
    for p in points:
        assert 0 < p["val_bits_per_byte"] < 16
        for name in ("sst", "imdb"):
            result = p[name]
            assert 0 <= result["test_accuracy"] <= 1 and 0 <= result["top_unit_accuracy"] <= 1
            assert result["C"] in report["settings"]["cs"] and 0 <= result["nonzero"] <= 64
        assert set(p["seconds"]) == {"val", "sst_features", "sst_probe", "imdb_features", "imdb_probe"}


def test_without_its_bundle_the_learning_part_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    learn = load_benchmark("gpu_learn.py", "gpu_learn", monkeypatch)
    assert learn.main(["--data", str(tmp_path / "nowhere"), "--preset", "tiny", "--cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pack_gpu_data.py" in err and "nowhere" in err
