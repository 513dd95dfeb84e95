"""infra/screenshots.py end to end, on a cheap command: real Prefect and MLflow servers, a corpus build
against them, headless Chromium screenshots of the two UIs showing what a person would look for (the
flow run's name and state, its artifacts, the MLflow run's metrics with their values), and nothing left
running afterwards. CI installs Chromium and sets MLSTM_REQUIRE_CHROMIUM=1 (.ci/run): there, a missing
browser fails the test instead of skipping it."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
SIZES = {
    "prefect-flow-run.png": (1600, 1100),
    "prefect-flow-run-artifacts.png": (1600, 1100),
    "mlflow-run.png": (1600, 1800),
}


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


def _distinct_colours(path: Path) -> int | None:
    """Colours in the picture (None: more than 65,536), or None without Pillow."""
    try:
        from PIL import Image
    except ImportError:
        return None
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    return None if colours is None else len(colours)


def _living_processes_mentioning(text: str) -> list[str]:
    """Processes whose environment or command line mentions text (zombies have neither)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            seen = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in seen:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.mark.slow
def test_screenshots_of_a_corpus_build(tmp_path: Path) -> None:
    if not os.access(CHROMIUM, os.X_OK):
        if os.environ.get("MLSTM_REQUIRE_CHROMIUM") == "1":
            pytest.fail(f"Chromium is required here (MLSTM_REQUIRE_CHROMIUM=1) but {CHROMIUM} is missing")
        pytest.skip(f"needs Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)")
    from tasks.corpus.sample import write_sample

    files = write_sample(tmp_path / "raw", num_reviews=300)
    store = tmp_path / "store"  # outside the script's folders, so that the manifest outlives its servers
    out = tmp_path / "img"
    # The script's temporary folders go under scratch, so that anything it left running can be found;
    # a short path, since Chromium's singleton socket lives there (at most 107 bytes).
    scratch = Path(tempfile.mkdtemp(prefix="mlstm-ss-", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(scratch)}
    env.pop("PREFECT_API_URL", None)
    command = f"mlstm-sentiment corpus build {files[0].parent} --store {store}"
    try:
        result = subprocess.run(
            [sys.executable, str(ROOT / "infra" / "screenshots.py"), "--out", str(out), "--command", command,
             "--flow", "build_corpus", "--mlflow-stage", "corpus"],
            env=env, capture_output=True, text=True, timeout=540,
        )  # fmt: skip
        left = _living_processes_mentioning(str(scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not left, f"the script left processes running: {left}"
    assert result.stdout.split() == [str(out / name) for name in SIZES]
    for name, size in SIZES.items():
        png = out / name
        assert _png_size(png) == size, name
        assert png.stat().st_size > 20_000, f"{name} is suspiciously small"  # a blank page is about 8 kB
        colours = _distinct_colours(png)
        assert colours is None or colours > 256, f"{name} has only {colours} colours"

    # What the pictures show, from the DOM Chromium drew them from, against what the build made.
    (manifest_path,) = store.glob("corpora/*/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    flow_run = _page_text(out / "prefect-flow-run.html")
    assert f"corpus-{files[0].parent.name}" in flow_run  # the flow run's name
    assert "Completed" in flow_run
    artifacts = _page_text(out / "prefect-flow-run-artifacts.html")
    for title in ("corpus-sources", "corpus-manifest"):
        assert title in artifacts, f"the Artifacts tab lacks {title}"
    mlflow_run = _page_text(out / "mlflow-run.html")
    expected = {f"{split}_rows": info["rows"] for split, info in manifest["splits"].items()}
    expected["records_kept"] = manifest["totals"]["kept"]
    for metric, value in expected.items():
        # A metric's row on the run page: its name, then its value (MLflow writes 2368.0 as 2368).
        assert re.search(rf"{metric}\s*{value}(?!\d)", mlflow_run), (
            f"the MLflow run page lacks {metric} = {value}"
        )


def _page_text(path: Path) -> str:
    """The text a person reads on a page: its DOM without tags, scripts and styles."""
    page = path.read_text()
    page = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.DOTALL | re.IGNORECASE)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))
