"""ASHA with promotion as resumption: a trial that reaches a rung stops there, suspended, and a trial
promoted to the next rung relaunches the same pretraining run with a larger ``max_steps``, so it
continues from its checkpoint. The rule that picks what a free worker does is ``tasks/sweep/asha.py``.

Optuna holds the sweep (its RDB storage: SQLite beside MLflow's database, or Postgres) and samples the
settings; it takes no halving decision. A trial's Optuna state is its place in ASHA: RUNNING while a
worker trains it, WAITING while it is suspended at a rung, COMPLETE at the last rung, PRUNED when the
sweep ended with it suspended below. Its objective at each rung is an intermediate value. A promotion
moves a trial from WAITING to RUNNING in one storage transaction that only one worker wins (the
transition Optuna's own trial queue relies on), so two workers never promote the same trial. Our own
bookkeeping rides in each trial's user attributes: the run name, the steps trained, the rung it is
trained to, and a lease that says which worker holds it. A worker that dies (a SIGKILL, a lost node)
leaves its lease to expire; the next worker takes the trial over to the same rung, so a rerun of a
killed sweep redoes no finished rung, and several workers can share one sweep.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tasks.jobs.environment import absolute_uri
from tasks.pretrain.config import PretrainParams
from tasks.pretrain.result import PretrainResult
from tasks.pretrain.stage import plan_job, resolve_corpus
from tasks.secrets import redact
from tasks.settings import Settings
from tasks.sweep.asha import Done, Promote, Standing, Start, Wait, next_move
from tasks.sweep.result import Best, BestTrial, SweepResult, TrialRow
from tasks.sweep.spec import Choice, IntUniform, LogUniform, SpecError, SweepSpec, Uniform

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

# A launch of one trial up to a rung: the pretraining job's result (``job_result``'s dict).
Launch = Callable[[PretrainParams], PretrainResult]
# Told after each rung: (trial number, its MLflow run id, rung steps, objective, state: suspended or
# complete).
RungHook = Callable[[int, str | None, int, float, str], None]
# Told when a trial is promoted or left at its rung as the sweep ends: (number, run id, state).
StateHook = Callable[[int, str | None, str], None]

STATES = {
    "COMPLETE": "complete",
    "PRUNED": "pruned",
    "RUNNING": "running",
    "FAIL": "failed",
    "WAITING": "suspended",
}


@dataclass(frozen=True)
class Claim:
    """A trial a worker holds, and the steps of the rung it is to be trained to."""

    trial_id: int
    number: int
    target: int


def storage_url(settings: Settings) -> str:
    """Optuna's database: ``MLSTM_SWEEP_STORAGE_URI``, else a SQLite file beside MLflow's."""
    if settings.sweep_storage_uri:
        return settings.sweep_storage_uri
    home = settings.home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'optuna.db'}"


def prepare(spec: SweepSpec, settings: Settings) -> SweepSpec:
    """The spec on a fixed corpus (``newest`` resolved, paths absolute), checked against it: every
    batch and sequence length a trial can draw fits the corpus and the ranks, before any trial starts."""
    corpus = absolute_uri(resolve_corpus(spec.corpus, settings))
    spec = spec.model_copy(update={"corpus": corpus})
    batches = spec.batch_values()
    seq_lens = _values(spec, "seq_len") or [int(spec.fixed.get("seq_len", 256))]
    try:
        # The largest batch of the longest rows is the hardest on the train split.
        params = spec.trial_params(
            {"batch_size": max(batches), "seq_len": max(seq_lens)}, "preflight", spec.budget.max_steps
        )
        plan_job(params, settings)
    except ValueError as error:
        raise SpecError(f"sweep on {corpus}: {error}") from None
    return spec


def _values(spec: SweepSpec, name: str) -> list[int]:
    dist = spec.space.get(name)
    if isinstance(dist, Choice):
        return [int(v) for v in dist.choice]
    if isinstance(dist, IntUniform):
        return list(dist.int_uniform)
    return []


class StorageUnavailable(RuntimeError):
    """The sweeps' database does not answer; the message names it (redacted) and its setting."""


def open_storage(settings: Settings) -> optuna.storages.RDBStorage:
    """Optuna's storage of the sweeps, connected: a database that does not answer is one clear error."""
    import optuna
    import sqlalchemy.exc

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # every reader of the sweeps opens it here
    url = storage_url(settings)
    # SQLite: wait for another worker's write instead of failing at once.
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.ArgumentError) as error:
        reason = str(getattr(error, "orig", None) or error).splitlines()[0]
        raise StorageUnavailable(
            f"the sweep storage at {redact(url)} does not answer ({reason}); start it, or fix "
            "MLSTM_SWEEP_STORAGE_URI"
        ) from None


def open_study(spec: SweepSpec, settings: Settings) -> optuna.Study:
    """The sweep's study, created on first use; the same spec opens the same study again."""
    import optuna

    storage = open_storage(settings)
    study = optuna.create_study(
        study_name=spec.sweep_id(),
        storage=storage,
        direction="minimize",
        sampler=sampler_for(spec, 0),
        pruner=optuna.pruners.NopPruner(),  # promotion is ASHA's (tasks/sweep/asha.py), not a pruner's
        load_if_exists=True,
    )
    if "spec" not in study.user_attrs:
        study.set_user_attr("spec", spec.model_dump(mode="json"))
    return study


def load_study(sweep_id: str, settings: Settings) -> optuna.Study:
    """An existing sweep by id, or a ``ValueError`` listing the sweeps there are."""
    import optuna

    storage = open_storage(settings)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if sweep_id not in names:
        known = ", ".join(names) or "none yet"
        raise ValueError(f"no sweep {sweep_id!r} in {storage_url(settings)} (sweeps there: {known})")
    return optuna.load_study(study_name=sweep_id, storage=storage)


def sampler_for(spec: SweepSpec, trial_number: int) -> optuna.samplers.BaseSampler:
    """The spec's sampler, seeded by the sweep's seed and the trial's number: trial k draws the same
    parameters whether the sweep ran straight through or was killed and continued."""
    import optuna

    seed = spec.seed * 1_000_003 + trial_number
    if spec.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if spec.sampler == "grid":
        grid = {name: list(dist.choice) for name, dist in spec.space.items() if isinstance(dist, Choice)}
        return optuna.samplers.GridSampler(grid, seed=spec.seed)
    return optuna.samplers.RandomSampler(seed=seed)


def suggest(trial: optuna.Trial, spec: SweepSpec) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, dist in spec.space.items():
        if isinstance(dist, LogUniform):
            values[name] = trial.suggest_float(name, *dist.log_uniform, log=True)
        elif isinstance(dist, Uniform):
            values[name] = trial.suggest_float(name, *dist.uniform)
        elif isinstance(dist, IntUniform):
            values[name] = trial.suggest_int(name, *dist.int_uniform)
        else:
            values[name] = trial.suggest_categorical(name, dist.choice)
    return values


def run_name(sweep_id: str, number: int) -> str:
    return f"{sweep_id}-t{number:03d}"


# -- leases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Worker:
    """Who holds a trial: this process (host and pid, so a dead one on this host is seen at once)."""

    owner: str
    lease_seconds: float

    @classmethod
    def here(cls, lease_seconds: float) -> Worker:
        return cls(f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}", lease_seconds)

    def lease(self) -> dict[str, Any]:
        return {"owner": self.owner, "until": time.time() + self.lease_seconds}


def lease_expired(lease: dict[str, Any] | None, now: float | None = None) -> bool:
    """True when nobody holds the trial: no lease, a lease run out, or its owner dead on this host."""
    if not lease:
        return True
    if (now or time.time()) > float(lease["until"]):
        return True
    host, pid, _ = str(lease["owner"]).split(":")
    if host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return False


@contextlib.contextmanager
def holding(study: optuna.Study, trial_id: int, worker: Worker) -> Iterator[None]:
    """Renew the lease on a trial while this worker trains it."""
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(worker.lease_seconds / 3):
            with contextlib.suppress(Exception):  # a missed renewal is retried; the lease is generous
                study._storage.set_trial_user_attr(trial_id, "lease", worker.lease())

    thread = threading.Thread(target=renew, name=f"lease-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# -- the sweep --------------------------------------------------------------------------------------


class Sweep:
    """Run a spec's trials by ASHA, ``parallel`` at once, resuming what a dead worker left."""

    def __init__(
        self,
        spec: SweepSpec,
        settings: Settings,
        launch: Launch,
        *,
        on_rung: RungHook | None = None,
        on_state: StateHook | None = None,
        lease_seconds: float | None = None,
        poll_seconds: float = 2.0,
    ) -> None:
        self.spec, self.settings, self.launch = spec, settings, launch
        self.on_rung = on_rung or (lambda *args: None)
        self.on_state = on_state or (lambda *args: None)
        self.study = open_study(spec, settings)
        self.worker = Worker.here(lease_seconds or settings.sweep_lease_seconds)
        self.rungs = spec.rungs()
        self.poll_seconds = poll_seconds
        self._lock = threading.Lock()  # one study object, shared by this process's worker threads

    @property
    def sweep_id(self) -> str:
        return self.spec.sweep_id()

    def run(self, parallel: int = 1) -> SweepResult:
        """Work until the sweep is over (by this worker or another); the summary."""
        if parallel == 1:
            self._work()
        else:
            with ThreadPoolExecutor(parallel, thread_name_prefix="sweep-worker") as pool:
                # Each thread carries this one's context (a Prefect flow run's, when there is one).
                futures = [pool.submit(contextvars.copy_context().run, self._work) for _ in range(parallel)]
                for future in futures:
                    future.result()
        return summary(self.study)

    def _work(self) -> None:
        while True:
            claimed = self.claim()
            if isinstance(claimed, Done):
                return
            if isinstance(claimed, Wait):
                time.sleep(self.poll_seconds)  # a running trial's rung may make a promotion possible
                continue
            self.train(claimed)

    def claim(self) -> Claim | Wait | Done:
        """What this worker trains next: a trial whose worker is gone, to the rung it was going to;
        else ASHA's move: a promotion or a new trial. ``Wait`` when there is nothing to do until
        another worker's trial reaches its rung; ``Done`` when the sweep is over (its suspended
        trials then marked pruned, every trial finished)."""
        from optuna.trial import TrialState

        with self._lock:
            while True:
                trials = sweep_trials(self.study)
                for frozen in trials:
                    if frozen.state is TrialState.RUNNING and self._lapsed(frozen):
                        return self._take_over(frozen)
                move = next_move(
                    [standing(t, self.rungs) for t in trials],
                    num_rungs=len(self.rungs),
                    eta=self.spec.asha.eta,
                    budget=self.spec.budget.trials,
                )
                if isinstance(move, Start):
                    return self._start() or Wait()
                if isinstance(move, Wait):
                    return move
                if isinstance(move, Done):
                    self._end(trials)
                    # Over once every trial is finished; another worker may still be ending one.
                    finished = all(t.state.is_finished() for t in sweep_trials(self.study))
                    return move if finished else Wait()
                assert isinstance(move, Promote)
                (frozen,) = [t for t in trials if t.number == move.number]
                if not take_waiting(self.study, frozen._trial_id):
                    continue  # another worker (process) promoted or ended it first: look again
                target = self.rungs[move.rung]
                self._set(frozen._trial_id, lease=self.worker.lease(), target=target)
                self.on_state(frozen.number, frozen.user_attrs.get("mlflow_run_id"), "promoted")
                return Claim(frozen._trial_id, frozen.number, target)

    def _take_over(self, frozen: FrozenTrial) -> Claim:
        import optuna

        self._set(frozen._trial_id, lease=self.worker.lease())
        if "values" not in frozen.user_attrs:  # its worker died before it drew settings
            self._begin(optuna.Trial(self.study, frozen._trial_id))
        target = int(frozen.user_attrs.get("target", self.rungs[0]))
        return Claim(frozen._trial_id, frozen.number, target)

    def _start(self) -> Claim | None:
        """A new trial at the bottom rung.

        Trial numbers come from the storage, so workers in several processes that ask at once get
        different numbers; one that gets a number past the budget marks that trial ``surplus`` (told
        failed, never trained, left out of every table) instead of running it. (Not ``study.ask``:
        it would hand out a suspended, WAITING trial as a new one.)"""
        import optuna
        from optuna.trial import TrialState

        storage = self.study._storage
        number = len(self.study.get_trials(deepcopy=False))
        self.study.sampler = sampler_for(self.spec, number)
        trial = optuna.Trial(self.study, storage.create_new_trial(self.study._study_id))
        trial.set_user_attr("lease", self.worker.lease())
        if trial.number >= self.spec.budget.trials:
            # Another worker (process) asked in the same instant and took the budget's last trial.
            trial.set_user_attr("surplus", True)
            self.study.tell(trial, state=TrialState.FAIL)
            return None
        self._begin(trial)
        trial.set_user_attr("target", self.rungs[0])
        return Claim(trial._trial_id, trial.number, self.rungs[0])

    def _begin(self, trial: optuna.Trial) -> None:
        """Draw a new trial's settings, by its own number: two workers that ask at once never draw the
        same settings, and trial k draws the same ones however the sweep's workers were timed."""
        self.study.sampler = sampler_for(self.spec, trial.number)
        values = suggest(trial, self.spec)
        for key, value in {
            "run": run_name(self.sweep_id, trial.number),
            "values": values,
            "steps": 0,
            "steps_trained": 0,
        }.items():
            trial.set_user_attr(key, value)

    def _end(self, trials: list[FrozenTrial]) -> None:
        """The sweep is over: each trial still suspended stays at its rung, told pruned."""
        from optuna.trial import TrialState

        for frozen in trials:
            if frozen.state is not TrialState.WAITING or not take_waiting(self.study, frozen._trial_id):
                continue  # not suspended, or another worker took it first
            self.study.tell(frozen.number, state=TrialState.PRUNED)  # its value: the last rung's
            self.on_state(frozen.number, frozen.user_attrs.get("mlflow_run_id"), "pruned")

    def _lapsed(self, frozen: FrozenTrial) -> bool:
        """True when a running trial's worker is gone. A trial with no lease yet was asked for (or
        promoted) an instant ago by a worker about to write one: it gets a lease's length to do so."""
        lease = frozen.user_attrs.get("lease")
        if lease is None:
            started = frozen.datetime_start
            return started is None or time.time() - started.timestamp() > self.worker.lease_seconds
        return lease_expired(lease)

    def _set(self, trial_id: int, **attrs: Any) -> None:
        for key, value in attrs.items():
            self.study._storage.set_trial_user_attr(trial_id, key, value)

    def train(self, claim: Claim) -> None:
        """Train a claimed trial to its rung (resuming its run), record the objective, and suspend it
        there, or complete it at the last rung."""
        from optuna.trial import TrialState

        storage = self.study._storage
        frozen = storage.get_trial(claim.trial_id)
        values, run = frozen.user_attrs["values"], frozen.user_attrs["run"]
        try:
            with holding(self.study, claim.trial_id, self.worker):
                result = self.launch(self.spec.trial_params(values, run, claim.target))
        except Exception:
            self._tell(claim.number, TrialState.FAIL)
            raise
        reported = result.val_bpc
        if reported is None:
            self._tell(claim.number, TrialState.FAIL)
            raise ValueError(
                f"trial {claim.number} (run {run}) reported no val_bpc at step {claim.target}: the val "
                "split is shorter than one batch row per rank"
            )
        value = float(reported)
        trained = result.steps - int(frozen.user_attrs["steps"])
        self._set(
            claim.trial_id,
            steps=result.steps,
            steps_trained=int(frozen.user_attrs["steps_trained"]) + max(trained, 0),
            mlflow_run_id=result.run_id,
            checkpoint_uri=result.checkpoint_uri,
        )
        storage.set_trial_intermediate_value(claim.trial_id, claim.target, value)
        if claim.target == self.rungs[-1]:
            self._tell(claim.number, TrialState.COMPLETE, value)
            state = "complete"
        else:
            # Suspended: no lease (nobody holds it), WAITING until a worker promotes it.
            self._set(claim.trial_id, lease=None)
            storage.set_trial_state_values(claim.trial_id, TrialState.WAITING)
            state = "suspended"
        self.on_rung(claim.number, result.run_id, claim.target, value, state)

    def _tell(self, number: int, state: Any, value: float | None = None) -> None:
        with self._lock:
            self.study.tell(number, value, state=state)


def take_waiting(study: optuna.Study, trial_id: int) -> bool:
    """Move a suspended trial from WAITING to RUNNING; True for exactly one of the workers that try.

    One conditional UPDATE, atomic on SQLite as on Postgres. (Optuna's own ``set_trial_state_values``
    reads, then writes: SQLite ignores its ``SELECT … FOR UPDATE``, and two workers that read WAITING
    at once both won.)"""
    import datetime

    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session
    from optuna.trial import TrialState

    storage = getattr(study._storage, "_backend", study._storage)  # under Optuna's cache, the RDB
    assert isinstance(storage, RDBStorage), "a sweep's study lives in an RDB storage (open_study)"
    now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)  # the storage keeps naive UTC
    with _create_scoped_session(storage.scoped_session) as session:
        updated = (
            session.query(models.TrialModel)
            .filter(models.TrialModel.trial_id == trial_id, models.TrialModel.state == TrialState.WAITING)
            .update(
                {models.TrialModel.state: TrialState.RUNNING, models.TrialModel._datetime_start_utc: now},
                synchronize_session=False,
            )
        )
    return bool(updated == 1)


def standing(frozen: FrozenTrial, rungs: list[int]) -> Standing:
    """A trial as ASHA's rule sees it: its objective at each rung reached, and whether it is in play."""
    from optuna.trial import TrialState

    reached = frozen.intermediate_values
    values: list[float] = []
    for rung in rungs:
        if rung not in reached:
            break
        values.append(float(reached[rung]))
    return Standing(
        frozen.number,
        tuple(values),
        busy=frozen.state is TrialState.RUNNING,
        out=frozen.state.is_finished(),
    )


def trial_state(frozen: FrozenTrial) -> str:
    """The state ``sweep status`` shows: running (to its first rung), promoted (resumed to a higher
    one), suspended (at a rung, promotable), complete, pruned (left at its rung), failed."""
    state = STATES.get(frozen.state.name, frozen.state.name.lower())
    if state == "running" and int(frozen.user_attrs.get("steps", 0)) > 0:
        return "promoted"
    return state


def sweep_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The sweep's trials: every trial of the study but the surplus ones a worker asked for too late."""
    return [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]


def trial_row(frozen: FrozenTrial) -> TrialRow:
    values = frozen.intermediate_values
    last = values[max(values)] if values else None
    return TrialRow(
        trial=frozen.number,
        state=trial_state(frozen),
        rung=len(values),
        steps=int(frozen.user_attrs.get("steps", 0)),
        value=frozen.value if frozen.value is not None else last,
        run=frozen.user_attrs.get("run"),
    )


def summary(study: optuna.Study) -> SweepResult:
    """What ``sweep --json`` prints: the best finished trial, every trial, the steps really trained."""
    from optuna.trial import TrialState

    trials = sweep_trials(study)
    complete = [t for t in trials if t.state is TrialState.COMPLETE and t.value is not None]
    best = None
    if complete:
        top = min(complete, key=lambda t: (t.value, t.number))
        best = Best(
            trial=top.number,
            params=top.user_attrs.get("values", top.params),
            value=top.value,
            run=top.user_attrs.get("run"),
            checkpoint_uri=top.user_attrs.get("checkpoint_uri"),
            run_id=top.user_attrs.get("mlflow_run_id"),
        )
    return SweepResult(
        sweep_id=study.study_name,
        best=best,
        trials=[trial_row(t) for t in trials],
        steps_trained=sum(int(t.user_attrs.get("steps_trained", 0)) for t in trials),
    )


def rung_history(study: optuna.Study) -> dict[int, dict[int, float]]:
    """Trial number → {rung steps: objective}: the curves of the objective-by-step plot."""
    return {t.number: dict(t.intermediate_values) for t in sweep_trials(study)}


def list_sweeps(settings: Settings) -> list[dict[str, Any]]:
    """Every sweep in the storage: id, start, trial count by state, best objective."""
    import optuna

    storage = open_storage(settings)
    rows = []
    for study in optuna.get_all_study_summaries(storage, include_best_trial=True):
        trials = sweep_trials(optuna.load_study(study_name=study.study_name, storage=storage))
        counts: dict[str, int] = {}
        for trial in trials:
            state = trial_state(trial)
            counts[state] = counts.get(state, 0) + 1
        rows.append(
            {
                "sweep_id": study.study_name,
                "started": f"{study.datetime_start:%Y-%m-%d %H:%M:%S}" if study.datetime_start else None,
                "trials": len(trials),
                "states": ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
                "best": study.best_trial.value if study.best_trial else None,
            }
        )
    return rows


def best_trial(sweep_id: str, settings: Settings) -> BestTrial:
    """The best finished trial of a sweep, with what the pipeline's lineage needs: its checkpoint,
    runs and corpus. A ``ValueError`` when the sweep has none yet."""
    study = load_study(sweep_id, settings)
    best = summary(study).best
    if best is None or not best.checkpoint_uri:
        raise ValueError(
            f"--from-sweep {sweep_id}: no trial has finished yet (`mlstm-sentiment sweep status {sweep_id}`)"
        )
    spec = study.user_attrs.get("spec", {})
    return BestTrial(
        **best.model_dump(),
        sweep_id=sweep_id,
        manifest_uri=spec.get("corpus"),
        sweep_run_id=study.user_attrs.get("mlflow_run_id"),
    )
