"""The ``mlstm-sentiment`` command: run any stage, or the whole job, from a terminal."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tasks.settings import TaskRunnerName, get_settings

app = typer.Typer(
    name="mlstm-sentiment",
    help="From raw Amazon reviews to a served sentiment classifier: corpus → mLSTM → probe → MLflow.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
corpus_app = typer.Typer(
    help="Build and inspect review corpora (Arrow shards + manifest).", no_args_is_help=True
)
app.add_typer(corpus_app, name="corpus")

err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

StoreOption = Annotated[
    str | None,
    typer.Option("--store", help="Store URI: a folder or s3://bucket/prefix. [env: MLSTM_STORE_URI]"),
]


class _RichSink:
    """Shows a flow's progress as a bar per stage."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task_id: Any = None

    def stage(self, description: str, total: float) -> None:
        if self.task_id is not None:
            self.progress.update(self.task_id, completed=self.progress.tasks[self.task_id].total)
        self.task_id = self.progress.add_task(description, total=total or 1)

    def advance(self, amount: float = 1) -> None:
        if self.task_id is not None:
            self.progress.advance(self.task_id, amount)


def _fail(problem: str | BaseException) -> typer.Exit:
    message = problem if isinstance(problem, str) else _message(problem)
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=2)


def _message(error: BaseException) -> str:
    """The one line a user sees for an expected failure; S3's own words get the setting to look at."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(error, ClientError | BotoCoreError | Boto3Error):
        settings = get_settings()
        where = settings.s3_endpoint_url or "AWS S3"
        return (
            f"the object store ({where}) failed after {settings.s3_max_attempts} attempts per call: "
            f"{error} [MLSTM_S3_ENDPOINT_URL, MLSTM_S3_MAX_ATTEMPTS]"
        )
    return str(error)


def _user_errors() -> tuple[type[BaseException], ...]:
    # What S3 says once botocore's and the task's retries are spent: an outage, a denied key.
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    from flows.runtime import PrefectUnavailable
    from tasks.corpus.sources import SourceError
    from tasks.store import StoreError
    from tasks.tracking import TrackingUnavailable

    return (
        SourceError, StoreError, PrefectUnavailable, TrackingUnavailable, ValueError,
        ClientError, BotoCoreError, Boto3Error,
    )  # fmt: skip


def _check_datasets(specs: list[str]) -> None:
    """Every dataset path exists here: a typo fails now, not after the corpus and the training."""
    from tasks.transfer.datasets import dataset_name

    for spec in specs:
        dataset_name(spec)


def run_corpus_build(
    sources: list[str],
    *,
    store: str | None,
    config: Any,
    task_runner: TaskRunnerName | None = None,
    workers: int | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Build a corpus as a Prefect flow run, or return at once if it is already built."""
    from flows import progress
    from flows.corpus import build_corpus
    from flows.runtime import prefect_api
    from flows.runtime import task_runner as make_task_runner
    from tasks.corpus.build import plan_corpus, read_manifest, summary_of
    from tasks.corpus.sources import expand_sources
    from tasks.store import store_of

    settings = get_settings(store_uri=store, task_runner=task_runner, max_workers=workers)
    target = store_of(settings)
    if any(s.startswith(("s3://", "http://", "https://")) for s in sources):
        # A missing source is an error before any flow run, remote ones included.
        expand_sources(sources, s3_endpoint_url=settings.s3_endpoint_url)
    else:
        # Local sources are cheap to fingerprint again: a corpus already built needs no flow run.
        plan = plan_corpus(sources, config, cache_path=settings.home / "cache" / "fingerprints.json")
        if target.exists(plan.manifest_key):
            return summary_of(read_manifest(target, plan.manifest_key), target.url(plan.manifest_key))
    flow = build_corpus.with_options(task_runner=make_task_runner(settings))
    columns = (TextColumn("{task.description:<24}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn())
    bar = Progress(*columns, console=err, disable=not show_progress)
    with prefect_api(settings), bar, progress.reporting_to(_RichSink(bar)):
        return flow(sources=sources, store=settings.resolved_store_uri, config=config)  # type: ignore[no-any-return]


@corpus_app.command("build")
def corpus_build(
    sources: Annotated[
        list[str], typer.Argument(help="Files, folders, globs, s3:// prefixes or http(s):// URLs.")
    ],
    store: StoreOption = None,
    split: Annotated[str, typer.Option(help="train:val:test proportions.")] = "1000:1:1",
    shard_mb: Annotated[int, typer.Option(min=1, help="Target shard size in MiB of text.")] = 256,
    bucket_mb: Annotated[int, typer.Option(min=1, help="Input MiB per dedupe bucket (bounds memory).")] = 128,
    piece_mb: Annotated[
        int, typer.Option(min=1, help="Plain files are parsed in pieces of this many MiB.")
    ] = 64,
    workers: Annotated[int | None, typer.Option(help="Parallel workers. [default: CPU count]")] = None,
    task_runner: Annotated[
        str | None, typer.Option(help="process, thread, dask or ray. [env: MLSTM_TASK_RUNNER]")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
) -> None:
    """Shard raw Amazon reviews (2014/2018/2023 formats) into deduplicated Arrow files with a manifest."""
    from tasks.corpus.build import CorpusConfig, parse_split

    try:
        config = CorpusConfig(
            split=parse_split(split), shard_mb=shard_mb, bucket_mb=bucket_mb, piece_mb=piece_mb
        )
        summary = run_corpus_build(
            sources,
            store=store,
            config=config,
            task_runner=task_runner,
            workers=workers,  # type: ignore[arg-type]
        )
    except _user_errors() as error:
        raise _fail(error) from None
    if as_json:
        print(json.dumps(summary))
        return
    _print_summary(summary)


def _print_summary(summary: dict[str, Any]) -> None:
    out.print(
        f"[bold green]corpus {summary['corpus_id']}[/]: {summary['rows']:,} rows, "
        f"{summary['duplicates']:,} duplicates removed, {summary['rejected']:,} rejected"
    )
    out.print(f"manifest: {summary['manifest_uri']}", highlight=False)


def _load_manifest(uri: str) -> dict[str, Any]:
    from tasks.store import split_object_uri

    settings = get_settings()
    store, key = split_object_uri(uri, endpoint_url=settings.s3_endpoint_url)
    if not store.exists(key):
        raise _fail(f"no manifest at {uri}")
    return json.loads(store.read_bytes(key))  # type: ignore[no-any-return]


@corpus_app.command("show")
def corpus_show(manifest_uri: Annotated[str, typer.Argument(help="URI of a corpus manifest.json.")]) -> None:
    """Print a corpus's splits and per-source counts."""
    manifest = _load_manifest(manifest_uri)
    splits = Table(title=f"corpus {manifest['corpus_id']} · cleaning {manifest['cleaning']['name']}")
    for column in ("split", "rows", "text MiB", "shards"):
        splits.add_column(column, justify="right")
    for name, info in manifest["splits"].items():
        splits.add_row(
            name, f"{info['rows']:,}", f"{info['text_bytes'] / 2**20:,.1f}", str(len(info["shards"]))
        )
    out.print(splits)
    sources = Table(title="sources")
    for column in ("source", "records", "kept", "duplicates", "rejected"):
        sources.add_column(column, justify="left" if column == "source" else "right")
    for s in manifest["sources"]:
        sources.add_row(s["name"], *(f"{s[k]:,}" for k in ("records", "kept", "duplicates", "rejected")))
    out.print(sources)
    out.print(f"rejected records: {manifest['rejected_uri']}", highlight=False)


@corpus_app.command("rejected")
def corpus_rejected(
    manifest_uri: Annotated[str, typer.Argument(help="URI of a corpus manifest.json.")],
    limit: Annotated[int, typer.Option(help="Show at most this many.")] = 20,
) -> None:
    """List rejected records: source, line, reason and the start of the raw line."""
    import pyarrow as pa

    from tasks.store import split_object_uri

    manifest = _load_manifest(manifest_uri)
    settings = get_settings()
    table = Table(title=f"rejected records of corpus {manifest['corpus_id']}")
    for column in ("source", "line", "reason", "raw"):
        table.add_column(column, overflow="fold")
    shown = 0
    for uri in manifest["rejected_files"]:
        store, key = split_object_uri(uri, endpoint_url=settings.s3_endpoint_url)
        rows = pa.ipc.open_file(pa.py_buffer(store.read_bytes(key))).read_all().to_pylist()
        for row in rows[: limit - shown]:
            raw = row["raw"][:80].decode("utf-8", "backslashreplace")
            table.add_row(row["source"].rpartition("/")[2], str(row["line"]), row["reason"], raw)
            shown += 1
    out.print(table)
    out.print(f"{manifest['totals']['rejected']:,} rejected in all")


@corpus_app.command("sample")
def corpus_sample(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the sample files into.")],
    reviews: Annotated[int, typer.Option(help="About how many reviews.")] = 3000,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same bytes).")] = 0,
) -> None:
    """Generate a small review sample in the real Amazon 2014, 2018 and 2023 formats."""
    from tasks.corpus.sample import write_sample

    for path in write_sample(out_dir, num_reviews=reviews, seed=seed):
        out.print(str(path), highlight=False)


def _run_flow(flow: Any, *, unit: str = "percent", show_progress: bool = True, **parameters: Any) -> Any:
    """Run a flow in this process against the configured Prefect API (or a temporary one), with a
    progress bar per stage on stderr."""
    from flows import progress
    from flows.runtime import prefect_api

    settings = get_settings()
    counter = (
        TaskProgressColumn()
        if unit == "percent"
        else TextColumn(f"{unit} {{task.completed:,.0f}}/{{task.total:,.0f}}")
    )
    columns = (TextColumn("{task.description:<24}"), BarColumn(), counter, TimeElapsedColumn())
    bar = Progress(*columns, console=err, disable=not show_progress)
    with prefect_api(settings), bar, progress.reporting_to(_RichSink(bar)):
        return flow(**parameters)


def run_pretrain(params: Any, *, show_progress: bool = True) -> dict[str, Any]:
    """Train as a Prefect flow run (the job itself under torchrun, Slurm or Kubernetes)."""
    from flows.pretrain import pretrain as pretrain_flow
    from tasks.pretrain.stage import plan_job

    plan_job(params, get_settings())  # bad settings fail here, before a Prefect API or a process starts
    return _run_flow(pretrain_flow, unit="step", show_progress=show_progress, params=params)  # type: ignore[no-any-return]


@app.command()
def pretrain(
    corpus: Annotated[str, typer.Option(help="URI of the corpus manifest.json.")],
    preset: Annotated[str, typer.Option(help="tiny, small, paper_4096 or paper_8192.")] = "tiny",
    launcher: Annotated[str, typer.Option(help="local (torchrun here), slurm or kubernetes.")] = "local",
    nodes: Annotated[int, typer.Option(min=1, help="Nodes (slurm, kubernetes).")] = 1,
    gpus_per_node: Annotated[int, typer.Option(min=0, help="GPUs per node, one process each.")] = 0,
    nproc: Annotated[
        int | None, typer.Option(min=1, help="Processes per node without GPUs. [default: 1]")
    ] = None,
    max_steps: Annotated[int | None, typer.Option(min=1, help="End this launch after this step.")] = None,
    total_steps: Annotated[
        int | None, typer.Option(min=1, help="Schedule length. [default: one epoch of train]")
    ] = None,
    run: Annotated[str | None, typer.Option(help="Run name; the same name resumes. [default: new]")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Global batch in rows.")] = 128,
    seq_len: Annotated[int, typer.Option(min=1, help="Truncated BPTT length in bytes.")] = 256,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 5e-4,
    lr_scaling: Annotated[str, typer.Option(help="none, linear or sqrt.")] = "none",
    warmup_steps: Annotated[int, typer.Option(min=0, help="Linear warm-up steps.")] = 0,
    precision: Annotated[str, typer.Option(help="auto, bf16, fp16 or fp32.")] = "auto",
    checkpoint_every: Annotated[int, typer.Option(min=1, help="Steps between checkpoints.")] = 1000,
    val_every: Annotated[int, typer.Option(min=1, help="Steps between validations.")] = 1000,
    retries: Annotated[int, typer.Option(min=0, help="Relaunches after a crash (resuming).")] = 2,
    store: StoreOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    """Pretrain the mLSTM on a corpus; relaunching with the same --run resumes from its latest checkpoint."""
    from pydantic import ValidationError

    from tasks.pretrain.launchers.base import LaunchError
    from tasks.pretrain.stage import PretrainParams, flag_errors

    if store:
        os.environ["MLSTM_STORE_URI"] = store
    try:
        params = PretrainParams(
            corpus=corpus, preset=preset, launcher=launcher, nodes=nodes, gpus_per_node=gpus_per_node,
            nproc=nproc, max_steps=max_steps, total_steps=total_steps, run=run, batch_size=batch_size,
            seq_len=seq_len, lr=lr, lr_scaling=lr_scaling, warmup_steps=warmup_steps, precision=precision,
            checkpoint_every=checkpoint_every, val_every=val_every, retries=retries,
        )  # fmt: skip
        result = run_pretrain(params)
    except ValidationError as error:
        raise _fail(flag_errors(error)) from None
    except (*_user_errors(), LaunchError) as error:
        raise _fail(error) from None
    if as_json:
        print(
            json.dumps({k: result[k] for k in ("run_id", "checkpoint_uri", "steps", "final_loss", "val_bpc")})
        )
        return
    out.print(
        f"[bold green]run {result['run']}[/]: step {result['steps']:,} of {result['total_steps']:,}, "
        f"loss {result['final_loss']:.4f}, val bpc {result['val_bpc']}"
    )
    out.print(f"checkpoint: {result['checkpoint_uri']}", highlight=False)
    out.print(f"MLflow run: {result['run_id']}", highlight=False)


def _feature_bar() -> Progress:
    columns = (
        TextColumn("{task.description:<24}"),
        BarColumn(),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} texts"),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=err)


@app.command()
def features(
    checkpoint: Annotated[
        str, typer.Option(help="Checkpoint URI: a step folder, a run folder or latest.json.")
    ],
    input: Annotated[Path, typer.Option("--input", help="A CSV or JSON-lines file (optionally .gz).")],
    output: Annotated[str, typer.Option(help="Arrow file to write: a path or s3://bucket/key.arrow.")],
    text_column: Annotated[str, typer.Option(help="The column holding the text.")] = "text",
    label_column: Annotated[
        str | None, typer.Option(help="A label column to copy beside the features.")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per batch (similar lengths together).")] = 64,
    store: StoreOption = None,
) -> None:
    """Write the mLSTM's final cell state for every row of a file (cached in the store)."""
    from tasks.pretrain.checkpoint import load_checkpoint
    from tasks.store import store_of
    from tasks.transfer.datasets import read_table
    from tasks.transfer.features import cached_features, features_table, write_output

    settings = get_settings(store_uri=store)
    try:
        texts, labels = read_table(input, text_column=text_column, label_column=label_column)
        model = load_checkpoint(checkpoint, endpoint_url=settings.s3_endpoint_url).model()
        target = store_of(settings)
        with _feature_bar() as bar:
            task_id = bar.add_task(f"features {input.name}", total=len(texts))
            found = cached_features(
                target,
                model,
                texts,
                batch_size=batch_size,
                on_batch=lambda rows, _: bar.advance(task_id, rows),
            )
        columns = {label_column: labels} if label_column and labels is not None else {}
        uri = write_output(
            features_table(found.features, **columns), output, endpoint_url=settings.s3_endpoint_url
        )
    except _user_errors() as error:  # DatasetError is a ValueError
        raise _fail(error) from None
    state = "from the cache" if found.cached else "computed"
    out.print(f"{len(texts):,} rows × {found.features.shape[1]} features ({state}): {uri}", highlight=False)


@app.command("import-weights")
def import_weights_command(
    source: Annotated[str, typer.Argument(help="Whose weights: openai (Radford et al. 2017, 4096 units).")],
    folder: Annotated[
        Path, typer.Argument(help="The release's folder: for openai, model/ with 0.npy … 14.npy.")
    ],
    run: Annotated[str | None, typer.Option(help="Run to import into. [default: openai-<H>]")] = None,
    store: StoreOption = None,
) -> None:
    """Import published mLSTM weights as a checkpoint in the store; print its URI."""
    from tasks.transfer.weights import import_weights

    settings = get_settings(store_uri=store)
    try:
        uri = import_weights(
            source, folder, settings.resolved_store_uri, run=run,
            endpoint_url=settings.s3_endpoint_url, max_attempts=settings.s3_max_attempts,
        )  # fmt: skip
    except _user_errors() as error:
        raise _fail(error) from None
    print(uri)  # stdout holds only the URI: CKPT=$(mlstm-sentiment import-weights openai model/)


def run_transfer(params: Any, *, show_progress: bool = True) -> dict[str, Any]:
    """Probe a checkpoint as a Prefect flow run."""
    from flows.transfer import transfer as transfer_flow

    return _run_flow(transfer_flow, show_progress=show_progress, params=params)  # type: ignore[no-any-return]


@app.command()
def transfer(
    checkpoint: Annotated[
        str, typer.Option(help="Checkpoint URI: a step folder, a run folder or latest.json.")
    ],
    dataset: Annotated[
        list[str],
        typer.Option(
            help="NAME=PATH, repeatable: SST (folder), IMDB (aclImdb folder, tarball or CSV), a table."
        ),
    ],
    text_column: Annotated[str | None, typer.Option(help="Text column of CSV/JSONL tables.")] = None,
    label_column: Annotated[str | None, typer.Option(help="Label column of CSV/JSONL tables.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per feature batch.")] = 64,
    c_min_log2: Annotated[int, typer.Option(help="Smallest C of the sweep, as a power of 2.")] = -8,
    c_max_log2: Annotated[int, typer.Option(help="Largest C of the sweep, as a power of 2.")] = 2,
    register: Annotated[
        str | None,
        typer.Option(help="Dataset whose classifier is registered. [default: the first; none: none]"),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the probe's solver.")] = 0,
    store: StoreOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {dataset: {test_accuracy, …}} on stdout.")
    ] = False,
) -> None:
    """Fit L1 logistic-regression probes on the mLSTM's features; find the sentiment neuron; register."""
    from pydantic import ValidationError

    from tasks.pretrain.stage import flag_errors
    from tasks.transfer.stage import TransferParams

    if store:
        os.environ["MLSTM_STORE_URI"] = store
    try:
        params = TransferParams(
            checkpoint=checkpoint, datasets=dataset, text_column=text_column, label_column=label_column,
            batch_size=batch_size, c_min_log2=c_min_log2, c_max_log2=c_max_log2, register_dataset=register, seed=seed,
        )  # fmt: skip
        _check_datasets(params.datasets)
        result = run_transfer(params)
    except ValidationError as error:
        raise _fail(flag_errors(error)) from None
    except _user_errors() as error:  # DatasetError is a ValueError
        raise _fail(error) from None
    if as_json:
        print(json.dumps(result["datasets"]))
        return
    _print_transfer(result)


def _print_transfer(result: dict[str, Any]) -> None:
    table = Table(title="L1 logistic regression on the final cell state")
    for column in (
        "dataset",
        "test acc",
        "dev acc",
        "C",
        "non-zero",
        "top unit",
        "its acc",
        "paper",
        "TF-IDF",
    ):
        table.add_column(column, justify="left" if column == "dataset" else "right")
    for report in result["reports"]:
        reference = report.get("reference", {})
        paper, tfidf = reference.get("radford_2017_mlstm_4096"), reference.get("tfidf_word_char_logreg")
        table.add_row(
            report["name"], f"{report['test_accuracy']:.2%}", f"{report['dev_accuracy']:.2%}", f"{report['C']:g}",
            str(report["nonzero"]), str(report["top_unit"]), f"{report['top_unit_accuracy']:.2%}",
            f"{paper:.2%}" if paper else "-", f"{tfidf:.2%}" if tfidf else "-",
        )  # fmt: skip
    out.print(table)
    registered = result.get("registered")
    if registered:
        out.print(
            f"registered {registered['name']} v{registered['version']}: {registered['reason']}",
            highlight=False,
        )
        out.print(
            f"serve it:  mlflow models serve -m {registered['champion_uri']} --env-manager local",
            highlight=False,
        )
    out.print(f"MLflow run: {result['run_id']}", highlight=False)


@app.command()
def predict(
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to score (or use --input).")] = None,
    model: Annotated[
        str | None, typer.Option(help="MLflow model URI. [default: models:/<MLSTM_MODEL_NAME>@champion]")
    ] = None,
    input: Annotated[Path | None, typer.Option("--input", help="A CSV or JSON-lines file of texts.")] = None,
    text_column: Annotated[str, typer.Option(help="The text column of --input.")] = "text",
    batch_size: Annotated[int, typer.Option(min=1, help="Texts per batch.")] = 64,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON lines {text, label, probability}.")
    ] = False,
) -> None:
    """Score texts with a registered classifier (the champion by default)."""
    from tasks.tracking import connect
    from tasks.transfer.datasets import read_table

    settings = get_settings()
    try:
        if input is not None:
            texts = [*(texts or []), *read_table(input, text_column=text_column)[0]]
        if not texts:
            raise _fail("nothing to score: give texts as arguments or --input FILE")
        connect(settings)
        import mlflow.pyfunc
        import pandas as pd
        from mlflow.exceptions import MlflowException

        uri = model or f"models:/{settings.model_name}@champion"
        try:
            classifier = mlflow.pyfunc.load_model(uri)
        except MlflowException as error:
            raise _fail(
                f"cannot load {uri} from {settings.resolved_mlflow_tracking_uri}: {error.message}"
            ) from None
        predicted = classifier.predict(pd.DataFrame({"text": texts}), params={"batch_size": batch_size})
    except _user_errors() as error:  # DatasetError is a ValueError
        raise _fail(error) from None
    rows = zip(texts, predicted["label"], predicted["probability"], strict=True)
    if as_json:
        for text, label, probability in rows:
            print(json.dumps({"text": text, "label": label, "probability": float(probability)}))
        return
    table = Table(title=uri)
    for column, justify in (("label", "left"), ("P(positive)", "right"), ("text", "left")):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for text, label, probability in rows:
        color = "green" if label == "positive" else "red"
        table.add_row(f"[{color}]{label}[/]", f"{probability:.3f}", text[:200])
    out.print(table)


def _pipeline_values(**flags: Any) -> dict[str, Any]:
    """Default pipeline parameters as a plain dict, for flags and ``--set`` to change."""
    from tasks.pipeline import PipelineParams

    return PipelineParams.model_construct().model_dump(mode="json") | flags


def run_pipeline(params: Any, *, show_progress: bool = True) -> dict[str, Any]:
    """The whole pipeline (or the stages ``params.stages`` names) as a Prefect flow run, here."""
    from flows.pipeline import pipeline as pipeline_flow
    from tasks.tracking import connect

    _check_datasets(params.transfer.datasets if "transfer" in params.stages else [])
    connect(get_settings())  # MLflow down: one clear error before any flow run or MLflow run exists
    return _run_flow(pipeline_flow, show_progress=show_progress, params=params)  # type: ignore[no-any-return]


SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="key=value, repeatable: pretrain.max_steps=500, transfer.c_max_log2=4, corpus.shard_mb=64.",
    ),
]


@app.command("pipeline")
def pipeline_command(
    sources: Annotated[
        list[str], typer.Argument(help="Raw reviews: files, folders, globs, s3:// or http(s)://.")
    ],
    dataset: Annotated[
        list[str] | None, typer.Option(help="NAME=PATH for the probes, repeatable (SST, IMDB, a table).")
    ] = None,
    preset: Annotated[str, typer.Option(help="tiny, small, paper_4096 or paper_8192.")] = "tiny",
    launcher: Annotated[str, typer.Option(help="local (torchrun here), slurm or kubernetes.")] = "local",
    max_steps: Annotated[int | None, typer.Option(min=1, help="End pretraining at this step.")] = None,
    force: Annotated[
        list[str] | None, typer.Option(help="Run this stage even if its inputs are unchanged; repeatable.")
    ] = None,
    set_: SetOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    """Run corpus → pretrain → transfer → register under one MLflow run; unchanged stages are skipped."""
    from tasks.pipeline import apply_overrides, validated

    try:
        values = _pipeline_values(sources=sources, force=force or [])
        values["pretrain"].update(preset=preset, launcher=launcher, max_steps=max_steps)
        values["transfer"]["datasets"] = dataset or []
        params = validated(apply_overrides(values, set_ or []))
        result = run_pipeline(params)
    except _user_errors() as error:
        raise _fail(error) from None
    _print_pipeline(result, as_json=as_json)


def _print_pipeline(result: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        keep = {"run_id", "stages", "corpus", "pretrain"}
        summary = {k: v for k, v in result.items() if k in keep}
        if "transfer" in result:
            summary["transfer"] = {k: result["transfer"][k] for k in ("run_id", "datasets", "registered")}
        print(json.dumps(summary, default=str))
        return
    table = Table(title=f"pipeline run {result['run_id']}")
    for column in ("stage", "state", "result", "MLflow run"):
        table.add_column(column, no_wrap=column != "result")
    outputs = {
        "corpus": lambda r: f"{r['rows']:,} rows",
        "pretrain": lambda r: f"step {r['steps']:,}, val {r['val_bpc']:.2f} bits/byte",
        "transfer": lambda r: ", ".join(
            f"{n} test {v['test_accuracy']:.2%}" for n, v in r["datasets"].items()
        ),
    }
    for stage, info in result["stages"].items():
        color = {"ran": "green", "skipped": "cyan"}.get(info.get("state", ""), "red")
        output = outputs[stage](result[stage]) if stage in result else "-"
        table.add_row(stage, f"[{color}]{info.get('state')}[/]", output, str(info.get("run_id") or "-")[:12])
    out.print(table)
    if "corpus" in result:
        out.print(f"manifest: {result['corpus']['manifest_uri']}", highlight=False)
    if "pretrain" in result:
        out.print(f"checkpoint: {result['pretrain']['checkpoint_uri']}", highlight=False)
    registered = (result.get("transfer") or {}).get("registered")
    if registered and result["stages"]["transfer"].get("state") == "skipped":
        out.print(f"model: {registered['name']} v{registered['version']}, unchanged", highlight=False)
    elif registered:
        out.print(
            f"registered {registered['name']} v{registered['version']}: {registered['reason']}",
            highlight=False,
        )


StageArgument = Annotated[str, typer.Argument(help="corpus, pretrain or transfer.")]


@app.command("run")
def run_stage(
    stage: StageArgument,
    from_: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="A pipeline's MLflow run id (its parameters and outputs are reused), or a manifest URI "
            "(pretrain) or checkpoint URI (transfer). [default: the newest pipeline run, if any]",
        ),
    ] = None,
    set_: SetOption = None,
    rest: Annotated[bool, typer.Option("--rest", help="Run the later stages too.")] = False,
    deployment: Annotated[
        str | None,
        typer.Option(
            help="Run through this deployment (e.g. pipeline/pipeline-weekly) on a worker, not here."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    """Rerun one stage (or, with --rest, the rest of the pipeline) on demand, here or on a worker."""
    from tasks.pipeline import STAGES, apply_overrides, stages_from, validated

    if stage not in STAGES:
        raise _fail(f"unknown stage {stage!r}: choose corpus, pretrain or transfer")
    try:
        values = _rerun_values(stage, from_)
        values.update(stages=stages_from(stage, rest=rest), force=[stage])  # type: ignore[arg-type]
        params = validated(apply_overrides(values, set_ or []))
        # Through a deployment, dataset paths are the worker's: run_pipeline checks them here.
        result = run_through_deployment(deployment, params) if deployment else run_pipeline(params)
    except _user_errors() as error:
        raise _fail(error) from None
    _print_pipeline(result, as_json=as_json)


def _rerun_values(stage: str, origin: str | None) -> dict[str, Any]:
    """The parameters a rerun starts from: a past pipeline run's (the newest by default) or a URI's."""
    from tasks.pipeline import pipeline_params_of, recent_pipelines

    settings = get_settings()
    if origin and ("/" in origin or ":" in origin):
        if stage == "corpus":
            raise ValueError("--from URI is a manifest (for pretrain) or a checkpoint (for transfer); "
                             "the corpus stage reads --set sources=…")  # fmt: skip
        key = "manifest_uri" if stage == "pretrain" else "checkpoint_uri"
        return _pipeline_values(**{key: origin})
    if origin is None:
        newest = recent_pipelines(settings, 1)
        if not newest:  # a fresh install: the defaults, and --set says the rest
            return _pipeline_values()
        origin = newest[0]["run_id"]
    values, tags = pipeline_params_of(origin, settings)
    values["manifest_uri"] = tags.get("manifest_uri") or values.get("manifest_uri")
    values["checkpoint_uri"] = tags.get("checkpoint_uri") or values.get("checkpoint_uri")
    return values


def run_through_deployment(name: str, params: Any) -> dict[str, Any]:
    """Create a run of a pipeline deployment, follow its state and logs until it ends; its result is
    read back from the MLflow run it made."""
    from flows.runtime import configured_api_url, follow_flow_run, prefect_api, submit_deployment
    from tasks.pipeline import pipeline_result_of

    settings = get_settings()
    if not configured_api_url(settings):
        raise ValueError(
            "--deployment needs a Prefect server: set PREFECT_API_URL (or MLSTM_PREFECT_API_URL)"
        )
    with prefect_api(settings):
        flow_run_id = submit_deployment(name, {"params": params.model_dump(mode="json")})
        err.print(f"flow run {flow_run_id} of {name}: waiting for a worker", highlight=False)
        state = follow_flow_run(
            flow_run_id, on_log=lambda line: err.print(line, style="dim", highlight=False)
        )
    if state != "COMPLETED":
        raise ValueError(f"flow run {flow_run_id} of {name} ended {state}; its logs are in the Prefect UI")
    return pipeline_result_of(flow_run_id, settings)


@app.command()
def status(
    limit: Annotated[int, typer.Option(min=1, help="How many runs.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines.")] = False,
) -> None:
    """Recent pipeline runs: their stages, metrics and model versions (from MLflow)."""
    from tasks.pipeline import recent_pipelines

    try:
        runs = recent_pipelines(get_settings(), limit)
    except _user_errors() as error:
        raise _fail(error) from None
    if as_json:
        for run in runs:
            print(json.dumps(run))
        return
    table = Table(title=f"pipeline runs ({get_settings().resolved_mlflow_tracking_uri})")
    for column in (
        "started (UTC)",
        "status",
        "corpus",
        "pretrain",
        "transfer",
        "metrics",
        "model",
        "MLflow run",
    ):
        table.add_column(column, overflow="fold")
    for run in runs:
        metrics = ", ".join(f"{k} {v:.4g}" for k, v in sorted(run["metrics"].items()) if k != "corpus_rows")
        table.add_row(
            run["started"].replace("T", " ").removesuffix("+00:00"), run["status"],
            *run["stages"].values(), metrics or "-", f"v{run['model_version']}" if run["model_version"] else "-",
            run["run_id"],
        )  # fmt: skip
    out.print(table)


@app.command()
def deploy(
    file: Annotated[Path, typer.Option(help="The Prefect deployment file.")] = Path("infra/prefect.yaml"),
    name: Annotated[list[str] | None, typer.Option(help="Only this deployment; repeatable.")] = None,
) -> None:
    """Create the work pools and concurrency limits infra/prefect.yaml names, then deploy every deployment."""
    from flows.deploy import DeployError
    from flows.deploy import deploy as deploy_file
    from flows.runtime import configured_api_url, prefect_api

    settings = get_settings()
    if not configured_api_url(settings):
        raise _fail("deploy needs a Prefect server: set PREFECT_API_URL (or MLSTM_PREFECT_API_URL)")
    try:
        with prefect_api(settings) as url:
            lines = deploy_file(file, name)
    except (*_user_errors(), DeployError) as error:
        raise _fail(error) from None
    for line in lines:
        out.print(line, highlight=False)
    out.print(f"at {url}; start workers with `prefect worker start --pool NAME`", highlight=False)


@app.command()
def promote(
    version: Annotated[int, typer.Argument(help="The model version to make @champion.")],
    reason: Annotated[
        str, typer.Option(help="Why (kept in the version's promotion tag).")
    ] = "promoted by hand",
) -> None:
    """Point @champion at a version by hand: a promotion, or a rollback to an earlier version."""
    from tasks.transfer.registry import promote as promote_version

    try:
        done = promote_version(version, get_settings(), reason=reason)
    except _user_errors() as error:
        raise _fail(error) from None
    before = f"v{done['previous']}" if done["previous"] else "no champion"
    out.print(f"{done['name']}@champion: {before} → v{done['version']}", highlight=False)


# In the generated reviews' words: the demo's tiny mLSTM has read nothing else.
DEMO_POSITIVE = "Absolutely love it! I would buy this tuner again in a heartbeat."
DEMO_NEGATIVE = "Very disappointed. I returned the tuner immediately."


@app.command()
def demo(
    reviews: Annotated[int, typer.Option(help="Reviews in the generated sample.")] = 3000,
    steps: Annotated[int, typer.Option(min=1, help="Pretraining steps of the tiny mLSTM.")] = 300,
) -> None:
    """Run the whole pipeline on embedded defaults: a generated sample, its corpus, a tiny mLSTM, its
    probe, the registered classifier, served and asked for two predictions."""
    from tasks.corpus.build import CorpusConfig
    from tasks.corpus.sample import write_labelled_sample, write_sample
    from tasks.pipeline import PipelineParams, PretrainStage, TransferStage
    from tasks.transfer.serve import invoke, served

    settings = get_settings()
    err.print(f"[bold]mlstm-sentiment demo[/] · home {settings.home.resolve()}")
    sample = write_sample(settings.home / "sample", num_reviews=reviews)
    labelled = write_labelled_sample(settings.home / "sample-labelled")
    err.print(
        f"1. generated {reviews:,} reviews in the 2014, 2018 and 2023 Amazon formats ({sample[0].parent}), "
        f"and held-out reviews labelled by their stars ({labelled})"
    )
    err.print(f"2. the pipeline: corpus → a tiny mLSTM ({steps} steps or one epoch) → probe → registry")
    params = PipelineParams(
        sources=[str(sample[0].parent)],
        # A sample this small needs bigger held-out splits than the paper's 1000:1:1 to be useful.
        corpus=CorpusConfig(split=(90, 5, 5)),
        pretrain=PretrainStage(
            preset="tiny", batch_size=16, seq_len=64, lr=3e-3, max_steps=steps,
            checkpoint_every=steps, val_every=steps, retries=0,
        ),
        transfer=TransferStage(datasets=[f"reviews={labelled}"]),
    )  # fmt: skip
    try:
        result = run_pipeline(params)
    except _user_errors() as error:
        raise _fail(error) from None
    _print_pipeline(result, as_json=False)
    model_uri = f"models:/{settings.model_name}@champion"
    err.print(f"3. serving {model_uri} with `mlflow models serve` and POSTing two reviews:")
    try:
        with served(
            model_uri, settings.resolved_mlflow_tracking_uri, log=settings.home / "logs" / "serve.log"
        ) as url:
            predictions = invoke(url, [DEMO_POSITIVE, DEMO_NEGATIVE])
    except RuntimeError as error:
        raise _fail(error) from None
    for text, prediction in zip((DEMO_POSITIVE, DEMO_NEGATIVE), predictions, strict=True):
        color = "green" if prediction["label"] == "positive" else "red"
        out.print(f"  [{color}]{prediction['label']:>8}[/] {prediction['probability']:.3f}  {text}")
    out.print("\nLook at it:")
    out.print("  mlstm-sentiment status            # pipeline runs, their stages and models", highlight=False)
    for line in _where_to_look(settings, result["run_id"]):
        out.print(f"  {line}", highlight=False, soft_wrap=True)
    out.print(f'  model: {model_uri}  (`mlstm-sentiment predict "…"`)', highlight=False)
    out.print(
        f"  MLFLOW_TRACKING_URI={settings.resolved_mlflow_tracking_uri} "
        f"mlflow models serve -m {model_uri} --env-manager local -p 5001",
        highlight=False,
        soft_wrap=True,
    )


def _where_to_look(settings: Any, run_id: str) -> list[str]:
    """The pipeline run in the MLflow and Prefect UIs: links to the servers in use, or how to start
    local ones on the demo's own files."""
    from mlflow.tracking import MlflowClient

    from flows.runtime import configured_api_url
    from tasks.tracking import experiment_id, ui_base

    experiment = experiment_id(settings)  # connects MLflow before the client is made
    flow_run_id = MlflowClient().get_run(run_id).data.tags.get("prefect_flow_run_id", "")
    mlflow_base = ui_base(settings)
    lines = [
        f"MLflow run: {mlflow_base}/#/experiments/{experiment}/runs/{run_id}"
        if mlflow_base
        else f"mlflow ui --backend-store-uri {settings.resolved_mlflow_tracking_uri}   # run {run_id}"
    ]
    prefect_api = configured_api_url(settings)
    if prefect_api:
        lines.append(
            f"Prefect flow run: {prefect_api.rstrip('/').removesuffix('/api')}/runs/flow-run/{flow_run_id}"
        )
    else:
        lines.append(
            f"prefect server start    # then http://127.0.0.1:4200/runs/flow-run/{flow_run_id}: "
            "the flow run, its subflows and artifacts"
        )
    return lines


@app.command("settings")
def show_settings() -> None:
    """Print the settings in force (from MLSTM_* variables and defaults)."""
    settings = get_settings()
    values = settings.model_dump(mode="json")
    values["resolved_store_uri"] = settings.resolved_store_uri
    values["resolved_mlflow_tracking_uri"] = settings.resolved_mlflow_tracking_uri
    print(json.dumps(values, indent=2))


@app.callback()
def _global_options(
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show Prefect's and MLflow's logs.")
    ] = False,
) -> None:
    """Quiet consoles by default: flow logs still reach the Prefect API (and its UI) in full."""
    level = "INFO" if verbose else "WARNING"
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", level)
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", level)
    if not verbose:  # set before Prefect configures its logging, here and in every worker process
        os.environ.setdefault(
            "PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS", "flows.console.ConsoleWithoutTracebacks"
        )


def main() -> None:
    # This machine's own tools need no phoning home; users can still turn either back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # MLflow prints a link to each run it ends on stdout, which --json keeps for the result alone.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    app()


if __name__ == "__main__":
    sys.exit(main())
