"""Sweeps from the outside: a bad spec is one error naming the key and line before any trial (the CLI's
too); `sweep status` reads Optuna's storage; sweeps of the real job on the shared corpus, one of them
killed half-way, where Optuna, MLflow, Prefect's artifact and the JSON agree and no finished rung is
redone; the pipeline takes a sweep's best trial; the deployment holds a valid spec. The engine's ASHA
scheduling, on a replayed job: ``test_sweep_asha.py``."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from sweep_helpers import CLI, Replay, write_spec

from tasks.corpus.sample import write_labelled_sample
from tasks.settings import Settings
from tasks.sweep.engine import Sweep
from tasks.sweep.spec import SpecError, load_spec, parse_spec

# -- the spec ---------------------------------------------------------------------------------------

BAD_SPECS = {
    # name: (what to change in the good spec, the key and line the error must name)
    "unknown key": ("colour: blue\n", "colour", 13),
    "unknown parameter": ("  dropout: {uniform: [0.0, 0.5]}\n", "space.dropout", 13),
    "empty range": ("  warmup_steps: {int_uniform: [5, 2]}\n", "space.warmup_steps.int_uniform", 13),
    "empty real range": ("  warmup_steps: {uniform: [3.0, 3.0]}\n", "space.warmup_steps.uniform", 13),
    "log range from zero": (
        "  warmup_steps: {log_uniform: [0.0, 10.0]}\n",
        "space.warmup_steps.log_uniform",
        13,
    ),
    "empty choice": ("  seq_len: {choice: []}\n", "space.seq_len.choice", 13),
    "unknown distribution": ("  warmup_steps: {normal: [0, 1]}\n", "space.warmup_steps", 13),
    "budget below one rung": ("", "budget.max_steps", 6),
    "batch the ranks cannot split": ("nproc: 3\n", "space.batch_size", 12),
    "unknown nested key": ("", "asha.rate", 7),
    "a fixed setting the sweep owns": ("max_steps: 5\n", "max_steps", 13),
    "a grid smaller than the budget": ("", "budget.trials", 6),
    # Every trial would fail minutes in (torch: "value cannot be converted to type float without overflow").
    "a range beyond float32": ("", "space.lr", 11),
}


@pytest.mark.parametrize("case", BAD_SPECS)
def test_a_bad_spec_is_one_error_naming_the_key_and_line(case: str, tmp_path: Path) -> None:
    extra, key, line = BAD_SPECS[case]
    path = write_spec(tmp_path / "spec.yaml", extra=extra)
    if case == "budget below one rung":
        path.write_text(path.read_text().replace("min_steps: 1", "min_steps: 10"))
    if case == "unknown nested key":
        path.write_text(path.read_text().replace("eta: 3", "rate: 3"))
    if case == "a range beyond float32":
        path.write_text(
            path.read_text().replace("log_uniform: [1.0e-4, 3.0e-2]", "log_uniform: [1.0e-4, 1.0e308]")
        )
    if case == "a grid smaller than the budget":  # 2 × 2 points for 6 trials
        text = path.read_text().replace("sampler: random", "sampler: grid")
        path.write_text(text.replace("log_uniform: [1.0e-4, 3.0e-2]", "choice: [1.0e-3, 1.0e-2]"))
    with pytest.raises(SpecError) as raised:
        load_spec(path)
    assert str(raised.value).startswith(f"{path}:{line}: {key}: "), str(raised.value)
    if case == "a grid smaller than the budget":
        assert (
            str(raised.value)
            == f"{path}:6: budget.trials: 6 trials but the grid has 4 points: ask for at most 4"
        )


# name: (a replacement in the good spec, the message's start after the file and line)
EXPLODING_SPECS = {
    "a range of batches with several ranks": (
        ("batch_size: {choice: [8, 16]}", "batch_size: {int_uniform: [8, 100000000000]}\nnproc: 2"),
        "space.batch_size: a range of batches holds some that do not split among 2 ranks",
    ),
    "a choice the settings refuse": (
        ("batch_size: {choice: [8, 16]}", "batch_size: {choice: [0, -8]}"),
        "space.batch_size: 0: Input should be greater than or equal to 1",
    ),
    "an infinite range": (("3.0e-2]", ".inf]"), "space.lr.log_uniform: log_uniform needs finite ends"),
    "a trillion trials": (("trials: 6", "trials: 1000000000000"), "budget.trials: Input should be less than"),
}


@pytest.mark.parametrize("case", EXPLODING_SPECS)
def test_a_spec_whose_numbers_explode_is_refused_by_key(case: str, tmp_path: Path) -> None:
    """Ranges are checked by their ends, never enumerated; every value must be one the settings take."""
    (old, new), message = EXPLODING_SPECS[case]
    path = write_spec(tmp_path / "spec.yaml")
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(SpecError) as raised:
        load_spec(path)
    assert str(raised.value).split(": ", 1)[1].startswith(message), str(raised.value)


def test_yaml_aliases_are_refused_before_they_expand(tmp_path: Path) -> None:
    """Nine lines of anchors make a billion keys (a 'billion laughs'), which walking the file for key lines
    would visit one by one; the spec is refused before."""
    level = ", ".join(f"k{j}: 1" for j in range(10))
    bomb = f"l0: &l0 {{{level}}}\n" + "".join(
        f"l{i}: &l{i} {{{', '.join(f'k{j}: *l{i - 1}' for j in range(10))}}}\n" for i in range(1, 9)
    )
    path = write_spec(tmp_path / "spec.yaml", extra=bomb)
    with pytest.raises(SpecError, match=r"YAML aliases \(\*name\) are not taken"):
        load_spec(path)


def test_the_cli_refuses_a_bad_spec_before_any_trial(tmp_path: Path, home: Path) -> None:
    path = write_spec(tmp_path / "spec.yaml", extra="nproc: 3\n")
    done = subprocess.run([CLI, "sweep", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {path}:12: space.batch_size: a batch of 8 rows does not split among 3 ranks"
    ]
    assert not (home / "optuna.db").exists() and not (home / "store" / "runs").exists()


def test_rungs_and_the_sweep_id() -> None:
    base: dict[str, Any] = {
        "corpus": "/c/manifest.json",
        "preset": "tiny",
        "budget": {"trials": 6, "max_steps": 90},
        "asha": {"min_steps": 10, "eta": 3},
        "space": {"lr": {"log_uniform": [1e-4, 1e-2]}},
    }
    spec = parse_spec(base)
    assert spec.rungs() == [10, 30, 90]
    assert parse_spec({**base, "budget": {"trials": 6, "max_steps": 50}}).rungs() == [10, 30, 50]
    assert parse_spec(dict(base)).sweep_id() == spec.sweep_id()  # the same spec is the same sweep
    assert parse_spec({**base, "seed": 1}).sweep_id() != spec.sweep_id()
    launch = spec.trial_params({"lr": 0.001}, "r", 30)
    assert (launch.max_steps, launch.total_steps, launch.run, launch.lr) == (30, 90, "r", 0.001)


@pytest.mark.slow
def test_sweep_status_reads_the_storage(tmp_path: Path, home: Path) -> None:
    """`sweep status` lists the sweeps in Optuna's storage and prints one sweep's JSON, as `sweep --json` does."""
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json", trials=3))
    result = Sweep(spec, Settings(home=home), Replay()).run().shown()
    listed = subprocess.run([CLI, "sweep", "status", "--json"], capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-3000:]
    (row,) = json.loads(listed.stdout)
    states = sorted(r["state"] for r in result["trials"])
    assert (row["sweep_id"], row["trials"]) == (spec.sweep_id(), 3)
    assert row["states"] == ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))
    assert row["best"] == result["best"]["value"]
    one = subprocess.run(
        [CLI, "sweep", "status", spec.sweep_id(), "--json"], capture_output=True, text=True, timeout=300
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert json.loads(one.stdout) == result
    unknown = subprocess.run(
        [CLI, "sweep", "status", "sweep-nope"], capture_output=True, text=True, timeout=300
    )
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "no sweep 'sweep-nope'" in unknown.stderr and spec.sweep_id() in unknown.stderr


# -- the real job -----------------------------------------------------------------------------------


def sweep_json(spec: Path, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [CLI, "sweep", str(spec), "--json", *extra], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def job_processes(home: Path) -> list[int]:
    """Processes running with this test's MLSTM_HOME: the training jobs it started."""
    marker = f"MLSTM_HOME={home.resolve()}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def loss_steps(client: Any, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "loss"))


@pytest.mark.long
@pytest.mark.timeout(2400)  # about a dozen launches of torchrun on two shared cores
def test_an_asha_sweep_of_the_real_job_on_the_shared_corpus(
    amazon_manifest: str, home: Path, tmp_path: Path, prefect_api_url: str
) -> None:
    import mlflow
    import optuna
    from mlflow.tracking import MlflowClient

    from tasks.jobs.checkpoint import read_latest
    from tasks.store import LocalStore

    # Rungs at 1 and 3 steps: the fewest launches that still promote, prune and resume.
    spec = write_spec(tmp_path / "spec.yaml", amazon_manifest, max_steps=3)
    result = sweep_json(spec)
    rungs = [1, 3]
    trials = result["trials"]
    assert len(trials) == 6 and {t["state"] for t in trials} <= {"complete", "pruned"}
    # ASHA spends fewer steps than the same trials run to completion, and trains each step once.
    assert result["steps_trained"] == sum(t["steps"] for t in trials) < 6 * 3
    for trial in trials:
        assert trial["steps"] == 3 if trial["state"] == "complete" else trial["steps"] in rungs[:-1]

    # The Prefect flow run carries the trial table as an artifact.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as prefect:
        tables = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["sweep-trials"]))
        )
    assert trials in [json.loads(t.data) if isinstance(t.data, str) else t.data for t in tables]

    # Optuna's storage, MLflow's child runs and the JSON agree on the trials and their states.
    study = optuna.load_study(study_name=result["sweep_id"], storage=f"sqlite:///{home / 'optuna.db'}")
    assert [(t.number, t.state.name.lower()) for t in study.trials] == [
        (t["trial"], t["state"]) for t in trials
    ]
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    client = MlflowClient()
    parent = client.search_runs(
        [client.get_experiment_by_name("mlstm-sentiment").experiment_id],
        f"tags.sweep_id = '{result['sweep_id']}' and tags.stage = 'sweep'",
    )[0]
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_trial = {int(c.data.tags["sweep_trial"]): c for c in children}
    assert len(children) == 6 and sorted(by_trial) == [t["trial"] for t in trials]
    for trial in trials:
        child = by_trial[trial["trial"]]
        assert child.data.tags["sweep_state"] == trial["state"]
        # Promoted trials resumed: the loss was logged once per step, never again from step 1.
        steps = loss_steps(client, child.info.run_id)
        assert steps == list(range(1, trial["steps"] + 1))
        objective = client.get_metric_history(child.info.run_id, "objective")
        assert sorted(m.step for m in objective) == [r for r in rungs if r <= trial["steps"]]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"objective_by_trial.png", "objective_by_step.png", "parallel_coordinates.png"} <= artifacts
    best = result["best"]
    assert by_trial[best["trial"]].data.tags["sweep_best"] == "true"
    assert parent.data.tags["best_checkpoint_uri"] == best["checkpoint_uri"]

    # The best trial, trained in three launches, ends where one straight run of its settings does.
    store = LocalStore(home / "store")
    sweep_loss = read_latest(store, best["run"])["loss"]  # type: ignore[index]
    straight = subprocess.run(
        [
            CLI, "pretrain", "--corpus", amazon_manifest, "--preset", "tiny", "--seq-len", "32",
            "--batch-size", str(best["params"]["batch_size"]), "--lr", repr(best["params"]["lr"]),
            "--max-steps", "3", "--total-steps", "3", "--run", "straight", "--json",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert json.loads(straight.stdout)["final_loss"] == pytest.approx(sweep_loss, abs=1e-6)

    # The pipeline takes its pretraining from the sweep: the best checkpoint, the sweep in the lineage.
    labelled = write_labelled_sample(tmp_path / "labelled", num_reviews=300)
    done = subprocess.run(
        [CLI, "pipeline", "--from-sweep", result["sweep_id"], "--dataset", f"reviews={labelled}", "--json"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    registered = json.loads(done.stdout)["transfer"]["registered"]
    tags = client.get_model_version(registered["name"], str(registered["version"])).tags
    assert tags["sweep_id"] == result["sweep_id"] and tags["checkpoint_uri"] == best["checkpoint_uri"]
    assert tags["pretrain_run_id"] == best["run_id"] and tags["sweep_trial"] == str(best["trial"])


# Each trial's objective at each rung it reached, from Optuna's storage.
RUNGS_REACHED = (
    "select t.number || ':' || v.step, v.intermediate_value from trial_intermediate_values v "
    "join trials t using (trial_id)"
)


@pytest.mark.long
@pytest.mark.timeout(2400)
def test_a_sweep_killed_half_way_finishes_without_redoing_a_rung(
    amazon_manifest: str, home: Path, tmp_path: Path, prefect_api_url: str
) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    spec = write_spec(tmp_path / "spec.yaml", amazon_manifest, trials=3, seed=1, max_steps=3)
    first = subprocess.Popen(
        [CLI, "sweep", str(spec), "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    database = home / "optuna.db"
    decided = 0
    deadline = time.monotonic() + 900
    while decided < 2 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
        if database.exists():
            with sqlite3.connect(database) as db:
                decided = db.execute("select count(*) from trial_intermediate_values").fetchone()[0]
    assert first.poll() is None, "the sweep ended before it could be killed half-way"
    os.kill(first.pid, signal.SIGKILL)  # the sweep, with no chance to clean up
    first.wait()
    # Its training job gets SIGTERM from the kernel (the launcher's parent-death signal) and checkpoints.
    while job_processes(home):
        time.sleep(0.5)
    with sqlite3.connect(database) as db:
        before = dict(db.execute(RUNGS_REACHED).fetchall())

    result = sweep_json(spec)
    assert len(result["trials"]) == 3 and {t["state"] for t in result["trials"]} <= {"complete", "pruned"}
    with sqlite3.connect(database) as db:
        after = dict(db.execute(RUNGS_REACHED).fetchall())
    assert before.items() <= after.items()  # rungs reached before the kill stand, with their objective
    mlflow.set_tracking_uri(f"sqlite:///{home / 'mlflow.db'}")
    client = MlflowClient()
    runs = client.search_runs(
        [client.get_experiment_by_name("mlstm-sentiment").experiment_id],
        f"tags.sweep_id = '{result['sweep_id']}' and tags.stage = 'pretrain'",
    )
    assert len(runs) == 3
    for run in runs:
        steps = loss_steps(client, run.info.run_id)
        assert len(steps) == len(set(steps)), f"{run.data.tags['run']} trained a step twice: {steps}"


def test_the_pipeline_takes_a_sweep_instead_of_pretraining() -> None:
    from tasks.pipeline import PipelineParams

    params = PipelineParams(stages=["transfer"], from_sweep="sweep-x", transfer={"datasets": ["a=b"]})
    assert params.checkpoint_uri is None  # the flow takes the sweep's best checkpoint
    with pytest.raises(ValueError, match="from_sweep: the sweep's best trial is the pretraining"):
        PipelineParams(
            stages=["pretrain", "transfer"], from_sweep="s", manifest_uri="m", transfer={"datasets": ["a=b"]}
        )
    with pytest.raises(ValueError, match="checkpoint_uri: transfer without the pretraining stage"):
        PipelineParams(stages=["transfer"], transfer={"datasets": ["a=b"]})


def test_from_sweep_names_a_sweep_that_exists(tmp_path: Path) -> None:
    from tasks.sweep.engine import best_trial

    settings = Settings(home=tmp_path / "home")
    spec = load_spec(write_spec(tmp_path / "spec.yaml", "/c/manifest.json", trials=1))
    Sweep(spec, settings, Replay()).run()
    assert best_trial(spec.sweep_id(), settings).manifest_uri == "/c/manifest.json"
    with pytest.raises(ValueError, match=f"no sweep 'sweep-nope' in .*sweeps there: {spec.sweep_id()}"):
        best_trial("sweep-nope", settings)


def test_the_sweep_deployment_holds_a_valid_spec() -> None:
    import yaml

    from tasks.sweep.spec import SweepSpec

    infra = Path(__file__).resolve().parents[1] / "infra" / "prefect.yaml"
    deployments = yaml.safe_load(infra.read_text())["deployments"]
    (deployment,) = [d for d in deployments if d["entrypoint"] == "flows/sweep.py:sweep"]
    spec = SweepSpec(**deployment["parameters"]["spec"])
    assert spec.rungs() == [1000, 3000, 9000, 27000] and spec.fixed["preset"] == "paper_4096"
    assert deployment["work_pool"]["name"] == "gpu"
