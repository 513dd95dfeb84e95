"""A full disk (issue 53): under MLSTM_HOME, one line naming it before the temporary Prefect API is
started (not a server that "did not start within 120 s"); under the store, one line naming the file
being written, and no empty folder of the failed write left behind. The disk is a real small tmpfs,
mounted for the test (root only: CI and this machine run the suite as root)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cli_in_process


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, filled to the last byte."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        with (mount / "filler").open("wb") as filler:
            try:
                filler.write(b"\0" * (1 << 20))
                filler.flush()
            except OSError:
                pass  # full
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_home_is_one_line_naming_it_before_prefect_starts(full_disk: Path, tmp_path: Path) -> None:
    reviews = tmp_path / "reviews.csv"
    reviews.write_text("id,text\n1,great\n")
    home = full_disk / "home"
    env: dict[str, str | None] = {
        "MLSTM_HOME": str(home),
        "PREFECT_API_URL": None,
        "PREFECT_HOME": str(home / "prefect"),  # as the CLI puts it, so a server would fail to start
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "20",
    }
    done = cli_in_process(["score", str(reviews), "--output", str(tmp_path / "out")], env)
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join(done.stderr.split())
    assert message.startswith(f"error: MLSTM_HOME {home}: no space left on device (0.0 MiB free;"), message
    assert "Prefect API did not start" not in message


@pytest.mark.parametrize(
    ("left_kib", "failing"),
    [(64, "_work/map/s00001-p0000/bucket-00000.arrow"), (128, "train/shard-00000-0000.arrow")],
    ids=["parsing", "publishing"],
)
def test_a_full_store_is_one_line_naming_the_file_and_leaves_no_empty_folder(
    left_kib: int, failing: str, full_disk: Path, tmp_path: Path
) -> None:
    """The disk fills as a piece's bucket files are written (Arrow's stream writer), or as a shard is
    (the store's writer): either is one line naming the file; the pieces done stay for the rerun."""
    from tasks.corpus.build import build_in_process, plan_corpus
    from tasks.corpus.config import CorpusConfig
    from tasks.corpus.sample import write_sample
    from tasks.store import LocalStore, StoreError

    (full_disk / "filler").write_bytes(b"\0" * ((256 - left_kib) << 10))
    sources = write_sample(tmp_path / "sample", num_reviews=300)
    plan = plan_corpus([str(p) for p in sources], CorpusConfig())
    store = LocalStore(full_disk / "store")
    with pytest.raises(StoreError) as raised:
        build_in_process(plan, store)
    assert str(raised.value) == (
        f"{store.root}/corpora/{plan.corpus_id}/{failing} cannot be written: no space left on device"
    )
    corpus = store.path(f"corpora/{plan.corpus_id}")
    empty = [folder for folder in corpus.rglob("*") if folder.is_dir() and not any(folder.iterdir())]
    assert empty == []
    assert list(corpus.rglob("_SUCCESS.json")), "the pieces done stay, for the rerun once there is space"
