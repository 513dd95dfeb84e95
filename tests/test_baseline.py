"""The measured TF-IDF baseline (tasks/transfer/baseline.py): what it learns, how it chooses C, its bad input."""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.transfer.baseline import fit_baseline
from tasks.transfer.datasets import DatasetError, load_dataset

WORDS = ["plot", "actor", "scene", "music", "story", "camera", "ending", "script", "cast", "pace"]


def _rows(n: int, seed: int, flip: bool = False) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randrange(2)
        cue = "wonderful" if label else "dreadful"
        text = " ".join([*rng.sample(WORDS, 4), cue, *rng.sample(WORDS, 3)])
        rows.append((text, 1 - label if flip else label))
    return rows


def _write(folder: Path, split: str, rows: list[tuple[str, int]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{split}.csv").open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(["text", "label"])
        writer.writerows(rows)


def _dataset(folder: Path, flip_test: bool = False) -> Path:
    _write(folder, "train", _rows(200, 1))
    _write(folder, "dev", _rows(60, 2))
    _write(folder, "test", _rows(60, 3, flip=flip_test))
    return folder


def test_the_baseline_learns_a_cue_word_and_the_test_labels_do_not_choose_C(tmp_path: Path) -> None:
    plain = fit_baseline(load_dataset(f"cue={_dataset(tmp_path / 'plain')}"))
    inverted = fit_baseline(load_dataset(f"cue={_dataset(tmp_path / 'inverted', flip_test=True)}"))
    # One word decides every label, so anything that learns scores far above chance (0.5).
    assert plain.test_accuracy > 0.9 and plain.dev_accuracy > 0.9
    # Inverting the test labels turns test accuracy into 1 - accuracy but must not move the choice of C:
    # a C chosen by test accuracy (a leak) would change here.
    assert inverted.test_accuracy == pytest.approx(1 - plain.test_accuracy)
    assert (inverted.C, inverted.dev_accuracy) == (plain.C, plain.dev_accuracy)


def test_an_empty_split_is_one_error_naming_the_source(tmp_path: Path) -> None:
    folder = _dataset(tmp_path / "d")
    _write(folder, "test", [])
    with pytest.raises(DatasetError, match=r"/d: the test split has no rows"):
        fit_baseline(load_dataset(f"cue={folder}"))


def test_a_one_class_train_split_is_one_error_naming_the_source(tmp_path: Path) -> None:
    folder = _dataset(tmp_path / "d")
    _write(folder, "train", [(text, 1) for text, _ in _rows(50, 4)])
    with pytest.raises(DatasetError, match=r"/d: the train split has only positive labels"):
        fit_baseline(load_dataset(f"cue={folder}"))


def test_texts_sharing_no_word_are_fitted_on_characters_and_sharing_nothing_is_one_error(
    tmp_path: Path,
) -> None:
    # Every train text is one word of its own (no word occurs twice, so min_df 2 keeps none), built
    # from a positive or negative stem the character n-grams can still learn.
    def rows(n: int, start: int) -> list[tuple[str, int]]:
        return [(f"{'glee' if i % 2 else 'gloom'}{i:05d}", i % 2) for i in range(start, start + n)]

    folder = tmp_path / "words"
    _write(folder, "train", rows(200, 0))
    _write(folder, "dev", rows(60, 1000))
    _write(folder, "test", rows(60, 2000))
    assert fit_baseline(load_dataset(f"unique={folder}")).test_accuracy > 0.9

    # One character per text, each a different one: no word and no character pair occurs at all.
    nothing = tmp_path / "nothing"
    _write(nothing, "train", [(chr(0x4E00 + i), i % 2) for i in range(40)])
    _write(nothing, "dev", rows(10, 0))
    _write(nothing, "test", rows(10, 0))
    with pytest.raises(
        DatasetError, match=r"/nothing: no word or character n-gram occurs in two train texts"
    ):
        fit_baseline(load_dataset(f"nothing={nothing}"))


CLI = str(Path(sys.executable).parent / "mlstm-sentiment")


@pytest.mark.slow  # starts the CLI
def test_baseline_json_names_each_dataset_with_its_figures(tmp_path: Path) -> None:
    done = subprocess.run(
        [CLI, "baseline", "--dataset", f"cue={_dataset(tmp_path / 'd')}", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    figures = json.loads(done.stdout)["cue"]
    assert set(figures) == {"test_accuracy", "dev_accuracy", "C", "seconds"}
    assert figures["test_accuracy"] > 0.9


@pytest.mark.slow  # starts the CLI once per case
@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b'text,label\n"good \xff film",1\nbad,0\n', "not UTF-8"),
        (b"text,stars\ngood,1\nbad,0\n", "no column 'label'"),
        (b"text,label\n" + b"".join(b"good film %d,1\n" % i for i in range(40)), "only positive labels"),
    ],
    ids=["non-utf8", "missing-label-column", "one-class"],
)
def test_bad_input_is_one_line_naming_the_file(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "reviews.csv"
    path.write_bytes(content)
    done = subprocess.run([CLI, "baseline", "--dataset", f"x={path}"], capture_output=True, text=True)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and problem in lines[0], done.stderr


def test_the_report_the_model_card_and_status_show_the_probe_beside_the_baseline() -> None:
    from tasks.pipeline.record import probe_vs_baseline
    from tasks.transfer.registry import model_card, report_markdown
    from tasks.transfer.result import BaselineReport, ProbeReport

    report = ProbeReport(
        name="sst2", spec="sst2=/data/sst2", source="/data/sst2", kind="sst", checksum="c" * 64,
        checkpoint_uri="file:///ckpt", dev_from_train=None, features_precision="fp32", rows={},
        test_accuracy=0.8, dev_accuracy=0.79, C=0.25, nonzero=40, top_unit=7, top_unit_accuracy=0.7,
        top_unit_sign=1, sweep=[], reference={"radford_2017_mlstm_4096": 0.918},
        baseline=BaselineReport(
            test_accuracy=0.8287, dev_accuracy=0.8211, C=1.0, seconds=1.0, method="TF-IDF …", cached=False
        ),
        probe_uri="file:///probe.npz", plots={}, heatmaps=[],
    )  # fmt: skip
    assert "80.00% vs baseline 82.87% (-2.87 points)" in model_card(report)
    assert "91.80% for the 4096-unit mLSTM (Radford et al. 2017" in model_card(report)
    row = next(line for line in report_markdown([report], None).splitlines() if line.startswith("| sst2"))
    assert row.startswith("| sst2 | 80.00% | 82.87% | -2.87 points |")
    no_baseline = report.model_copy(update={"baseline": None})
    assert "80.00% (no baseline measured)" in model_card(no_baseline)
    metrics = {"sst2_test_accuracy": 0.8, "sst2_baseline_test_accuracy": 0.8287, "imdb_test_accuracy": 0.9}
    assert probe_vs_baseline(metrics) == {
        "sst2": {"test_accuracy": 0.8, "baseline_test_accuracy": 0.8287, "difference": pytest.approx(-0.0287)}
    }
