"""What the CLI writes stays in MLSTM_HOME: matplotlib's config and font cache are not left in the
user's ~/.config or ~/.cache; and an MLSTM_HOME that cannot be one is named in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DRAW = """
import flows.cli
from tasks.settings import get_settings
flows.cli._caches_in_ours(get_settings().home.resolve())  # what `mlstm-sentiment` does before any command
from matplotlib.figure import Figure
Figure().add_subplot().set_title("font cache")  # builds matplotlib's font list on first use
Figure().savefig("plot.png")
"""


def test_the_plots_caches_stay_in_mlstm_home(tmp_path: Path) -> None:
    user_home, home = tmp_path / "user", tmp_path / "mlstm-home"
    user_home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPL", "XDG_", "MLSTM_"))}
    done = subprocess.run(
        [sys.executable, "-c", DRAW],
        cwd=tmp_path,
        env={**env, "HOME": str(user_home), "MLSTM_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(user_home.rglob("*")) == []
    assert list((home / "cache" / "matplotlib").glob("fontlist-*.json"))


def test_a_home_that_is_a_file_is_named_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("not a folder")
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mlstm-sentiment"), "status"],
        env={**os.environ, "MLSTM_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        == f"error: home: MLSTM_HOME {home} is a file: give a folder (it is made if missing)"
    )
