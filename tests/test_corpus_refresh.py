"""The weekly ``corpus-refresh`` deployment: its parameters (infra/prefect.yaml) grow the newest corpus by
the week's new files, and build in full, saying why in one line, where no delta can be built. The corpus
flow itself (real Prefect: the test harness's API, MLflow on a SQLite file), on a few hundred generated
reviews; ``corpus build --base`` without ``--fallback full`` still refuses."""

from __future__ import annotations

import asyncio
import gzip
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import cli_in_process
from corpus_helpers import build, parsed_pieces

from tasks.corpus.build import CorpusConfig, plan_corpus
from tasks.corpus.manifest import Manifest, read_manifest
from tasks.corpus.result import CorpusResult
from tasks.corpus.sample import write_sample
from tasks.store import LocalStore

PREFECT_FILE = Path(__file__).resolve().parents[1] / "infra" / "prefect.yaml"


def _deployment_parameters() -> dict[str, Any]:
    """corpus-refresh's parameters as a run of the deployment gets them (its sources are replaced)."""
    deployments = yaml.safe_load(PREFECT_FILE.read_text())["deployments"]
    parameters: dict[str, Any] = next(d for d in deployments if d["name"] == "corpus-refresh")["parameters"]
    return parameters


@pytest.fixture(scope="module")
def week_one(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], Manifest]:
    """A store holding last week's corpus, built with the deployment's settings, and its sources."""
    root = tmp_path_factory.mktemp("refresh")
    sources = write_sample(root / "raw", num_reviews=300, seed=1)
    config = CorpusConfig(**_deployment_parameters()["config"]).model_copy(update={"base": None})
    return root, sources, build(sources, root / "store", config)


def _new_file(folder: Path) -> Path:
    """The week's new file: generated reviews under a name of their own (a dated dump's)."""
    generated = write_sample(folder / "generated", num_reviews=150, seed=2)[1]
    return Path(shutil.copy(generated, folder / f"week-2-{generated.name}"))


def _revised(source: Path, folder: Path) -> Path:
    """``source`` re-exported under its own name, with its last reviews removed: a changed source."""
    folder.mkdir(parents=True)
    revised = folder / source.name
    revised.write_bytes(gzip.compress(gzip.decompress(source.read_bytes())[:-200], mtime=0))
    return revised


@contextmanager
def _flow_log() -> Iterator[list[str]]:
    """The lines the flow run's logger writes. A handler of its own: Prefect's logging setup may stop
    its loggers' records from reaching the root logger, where pytest's caplog listens."""
    lines: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, logger = Kept(level=logging.INFO), logging.getLogger("prefect.flow_runs")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def _refresh(
    sources: list[Path], monkeypatch: pytest.MonkeyPatch
) -> tuple[CorpusResult, list[str], str, list[str]]:
    """A run of the corpus flow with the deployment's parameters: its result, the sources it parsed, its
    corpus-manifest artifact and its flow run log's lines. Threads, so that this process sees every piece parsed."""
    from prefect.client.orchestration import get_client
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.corpus import build_corpus

    parsed = parsed_pieces(monkeypatch)
    parameters = {**_deployment_parameters(), "sources": [str(source) for source in sources]}
    with _flow_log() as log:
        state = build_corpus.with_options(task_runner=ThreadPoolTaskRunner(max_workers=2))(
            **parameters, return_state=True
        )
    result: CorpusResult = state.result()

    async def artifact() -> str:
        async with get_client() as client:
            found = await client.read_artifacts()
        run_id = state.state_details.flow_run_id
        return next(str(a.data) for a in found if a.key == "corpus-manifest" and a.flow_run_id == run_id)

    return result, sorted({p.source.name for p in parsed}), asyncio.run(artifact()), log


def _store_with(root: Path, home: Path) -> Path:
    """A copy of last week's store where the flow's settings find it (MLSTM_HOME/store)."""
    shutil.copytree(root / "store", home / "store")
    return home / "store"


def test_the_deployment_grows_the_newest_corpus_reading_only_the_new_file(
    week_one: tuple[Path, list[Path], Manifest],
    prefect_api_url: str,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, sources, first = week_one
    store = _store_with(root, home)
    new = _new_file(tmp_path / "week-2")
    result, parsed, artifact, _ = _refresh([*sources, new], monkeypatch)
    assert parsed == [new.name]  # last week's files are not read again
    grown = read_manifest(LocalStore(store), f"corpora/{result.corpus_id}/manifest.json")
    assert grown.parent is not None and grown.parent.corpus_id == first.corpus_id
    assert grown.delta is not None and grown.delta.sources == [new.name]
    assert result.full_build_reason is None and "built in full" not in artifact
    assert f"delta of {grown.delta.totals.kept:,} rows on corpus `{first.corpus_id}`" in artifact


def test_on_an_empty_store_the_deployment_builds_in_full_and_says_why(
    week_one: tuple[Path, list[Path], Manifest],
    prefect_api_url: str,
    home: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, sources, first = week_one
    result, parsed, artifact, log = _refresh(sources, monkeypatch)
    assert result.corpus_id == first.corpus_id  # the full build of these sources, as built by hand
    assert parsed == sorted(source.name for source in sources)
    why = result.full_build_reason
    assert why is not None and "\n" not in why
    assert why == f"--base newest: no corpus is published in {home / 'store'}/; the corpus is built in full"
    assert why in log  # the flow run's log
    assert f"built in full: {why}" in artifact


def test_a_changed_base_source_makes_the_deployment_build_in_full_and_say_why(
    week_one: tuple[Path, list[Path], Manifest],
    prefect_api_url: str,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, sources, first = week_one
    store = _store_with(root, home)
    gift_cards = next(source for source in sources if source.name.startswith("Gift"))
    revised = _revised(gift_cards, tmp_path / "revised")
    given = [revised if source == gift_cards else source for source in sources]
    result, parsed, artifact, log = _refresh(given, monkeypatch)
    assert parsed == sorted(source.name for source in sources)  # every source, read again
    config = CorpusConfig(**_deployment_parameters()["config"]).model_copy(update={"base": None})
    assert result.corpus_id == plan_corpus([str(source) for source in given], config).corpus_id
    rebuilt = read_manifest(LocalStore(store), f"corpora/{result.corpus_id}/manifest.json")
    assert rebuilt.parent is None and rebuilt.delta is None
    why = result.full_build_reason
    assert why is not None and "\n" not in why
    assert why.startswith(f"--base newest: source {gift_cards.name} changed since corpus {first.corpus_id}")
    assert why.endswith("a delta only adds sources; the corpus is built in full")
    assert why in log  # the flow run's log
    assert f"built in full: {why}" in artifact


def test_the_command_stays_strict_without_fallback_full(
    week_one: tuple[Path, list[Path], Manifest], tmp_path: Path
) -> None:
    """``corpus build --base`` refuses a delta it cannot build, before any flow run (in this process: no
    Prefect API); a fallback that is not one of its choices is refused naming the flag."""
    root, sources, first = week_one
    store = shutil.copytree(root / "store", tmp_path / "store")
    gift_cards = next(source for source in sources if source.name.startswith("Gift"))
    revised = _revised(gift_cards, tmp_path / "revised")
    given = [str(revised if source == gift_cards else source) for source in sources]
    env: dict[str, str | None] = {"MLSTM_HOME": str(tmp_path / "home"), "MLSTM_STORE_URI": str(store)}
    refused = cli_in_process(["corpus", "build", *given, "--split", "1000:1:1", "--base", "newest"], env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert f"source {gift_cards.name} changed since corpus {first.corpus_id}" in refused.stderr
    assert "--fallback full" in refused.stderr  # the way to ask for a full build instead
    assert sorted(p.name for p in (store / "corpora").iterdir()) == [first.corpus_id]  # no work done

    bad = cli_in_process(["corpus", "build", *given, "--base", "newest", "--fallback", "always"], env)
    assert bad.returncode == 2 and "'--fallback'" in bad.stderr and "'refuse', 'full'" in bad.stderr
