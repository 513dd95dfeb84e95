"""The probe benchmark's verdict: when the solver's answer counts as liblinear's."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import load_benchmark


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # benchmarks/ is no package: load the script by path, with its folder on the path for `common`.
    return load_benchmark("probe.py", "probe_benchmark", monkeypatch)


# liblinear chose 2^-1 (dev 0.8); at 2^0 its own probe scored 0.79 on dev.
BASE = {"C": 0.5, "dev_accuracy": 0.8, "test_accuracy": 0.75}
LIBLINEAR_DEV = {0.5: 0.8, 1.0: 0.79}


@pytest.mark.parametrize(
    ("C", "dev", "test", "same"),
    [
        (0.5, 0.8, 0.752, True),  # the same C
        (1.0, 0.8, 0.752, True),  # another C, the same best dev: a tie of the choice
        (1.0, 0.8, 0.76, False),  # ... but test 1 point away
        (1.0, 0.81, 0.752, False),  # another C and a better dev: not liblinear's answer
    ],
)
def test_a_dev_tie_is_the_same_best_dev_and_test_within_half_a_point(
    probe: ModuleType, C: float, dev: float, test: float, same: bool
) -> None:
    fast = SimpleNamespace(C=C, dev_accuracy=dev, test_accuracy=test)
    assert probe.same_answer(BASE, fast, LIBLINEAR_DEV) is same


def test_liblinears_own_tie_at_the_solvers_C_counts_too(probe: ModuleType) -> None:
    fast = SimpleNamespace(C=1.0, dev_accuracy=0.79, test_accuracy=0.75)
    assert probe.same_answer(BASE, fast, {0.5: 0.8, 1.0: 0.8})
    assert not probe.same_answer(BASE, fast, LIBLINEAR_DEV)


def test_the_speed_up_goal_is_asked_of_every_row_4096_wide_the_demo_s_reviews_as_sst_sized(
    probe: ModuleType,
) -> None:
    """10× of SST-sized rows, the demo's labelled reviews (generated at SST's train size) among them, 5× of
    IMDB-sized ones, from 4,096 features; nothing of narrower rows."""
    specs = ("sst:4096", "real-sst:4096", "real-sample:4096", "sst:4096:lognormal-1:0.05:8", "imdb:4096")
    assert [probe.speedup_goal(probe.parse_case(s)) for s in specs] == [10, 10, 10, 10, 5]
    assert [probe.speedup_goal(probe.parse_case(s)) for s in ("real-sample:1024", "sst:1024")] == [None] * 2


def test_liblinear_refitted_tighter_reaches_newtons_objective_and_the_line_says_so(probe: ModuleType) -> None:
    # Badly scaled, correlated columns, where liblinear at its default tolerance stops above the minimum.
    from tasks.transfer.probe import fit_probe

    splits = probe.cell_state_like((800, 200, 200), 64, scales="lognormal-2", noise=0.05)
    Cs = (0.5, 1.0)
    lib, new = (
        fit_probe(*splits[0], *splits[1], *splits[2], Cs=Cs, solver=s) for s in ("liblinear", "newton")
    )
    row = probe.row_of(
        probe.parse_case("sst:64:lognormal-2:0.05"), "newton", probe.baseline_of(lib, 1.0), new, 0.5, 1
    )
    row["liblinear_tightened"] = tight = probe.tightened_liblinear(splits, list(Cs))
    for p, default, ours in zip(tight["per_C"], lib.sweep, new.sweep, strict=True):
        assert p["objective"] < default.objective  # the default stopped short here
        assert abs(p["objective"] - ours.objective) <= 1e-7 * ours.objective  # the minimum newton reached
    line = probe.tightened_line(row)
    assert line.startswith("sst-sized × 64, lognormal-2 scales, noise 0.05: liblinear refitted at tol 1e-08")
    assert f"picks C = {tight['C']:g} (newton chose {new.C:g})" in line
    # Where liblinear's own fit at a chosen C already took long, the refit (longer still) is skipped, said.
    base = probe.baseline_of(lib, 1.0)
    base["per_C"][1]["seconds"] = 1251.0
    row["liblinear_tightened"] = probe.tightened_liblinear(splits, list(Cs), base, max_seconds=120)
    assert probe.tightened_line(row) == (
        "sst-sized × 64, lognormal-2 scales, noise 0.05: liblinear not refitted at tol 1e-08 at the two "
        "chosen C: liblinear's own fit at C = 1 took 1,251 s at its default tolerance, past "
        "--tighten-max-seconds 120."
    )
    assert "per_C" in probe.tightened_liblinear(splits, list(Cs), base, max_seconds=2000)


def test_newton_refitted_tighter_along_its_path_gives_each_chosen_C_and_the_line_says_so(
    probe: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where liblinear's refit would take hours (real 4,096-wide cell states), newton's takes seconds: its
    # answer at both chosen C, at a tolerance 10⁴ times its default, along the path up to the larger.
    from tasks.transfer.probe import fit_probe

    splits = probe.cell_state_like((800, 200, 200), 64, scales="lognormal-2", noise=0.05)
    Cs = (0.25, 0.5, 1.0, 2.0)
    lib, new = (
        fit_probe(*splits[0], *splits[1], *splits[2], Cs=Cs, solver=s) for s in ("liblinear", "newton")
    )
    row = probe.row_of(
        probe.parse_case("sst:64:lognormal-2:0.05"), "newton", probe.baseline_of(lib, 1.0), new, 0.5, 1
    )
    paths: list[tuple[tuple[float, ...], float]] = []
    path = probe.newton.l1_logistic_path

    def watched(X: np.ndarray, y: np.ndarray, Cs: tuple[float, ...], **kwargs: Any) -> Any:
        paths.append((Cs, kwargs["tol"]))
        return path(X, y, Cs, **kwargs)

    monkeypatch.setattr(probe.newton, "l1_logistic_path", watched)
    row["solver_tightened"] = tight = probe.tightened_newton(splits, Cs, [1.0, 0.25], "cpu")
    # From the smallest C, warm-started, not past the larger; at 1e-7, and tighter only if a gap asks it
    # (on two threads torch's sums round otherwise, and this case's gap at 1e-7 lands either side of 1e-8).
    assert paths == [((0.25, 0.5, 1.0), tol) for tol in tight["tried"]] and tight["tried"][0] == 1e-7
    assert [p["C"] for p in tight["per_C"]] == [0.25, 1.0] and tight["tol"] == tight["tried"][-1]
    ours = {p.C: p.objective for p in new.sweep}
    for p in tight["per_C"]:
        assert p["converged"] and abs(p["objective"] - ours[p["C"]]) <= 1e-6 * ours[p["C"]]
        assert 0 <= p["duality_gap"] <= 1e-8  # certified: the minimum, to that (relative)
    best = max(p["dev_accuracy"] for p in tight["per_C"])
    assert tight["C"] == min(p["C"] for p in tight["per_C"] if p["dev_accuracy"] == best)
    line = probe.tightened_line(row, "solver_tightened")
    tighter = "" if tight["tol"] == 1e-7 else "; at 1e-07 a duality gap was above 1e-08"
    assert line.startswith(
        f"sst-sized × 64, lognormal-2 scales, noise 0.05: newton refitted at tol {tight['tol']:g} (its "
        f"default 0.001{tighter}) along its path at the two chosen C: C = 0.25: objective "
    )
    assert line.endswith(f"; its dev accuracy picks C = {tight['C']:g} (liblinear chose {lib.C:g}).")
    assert f"(at most {tight['per_C'][0]['duality_gap']:.1e} above the minimum: its duality gap; " in line


def test_newton_refitted_tighter_until_its_duality_gap_certifies_each_chosen_C(
    probe: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its stopping rule bounds residuals, not the gap: a refit whose gap at a chosen C is over the bound is
    # refitted ten times tighter, and the first tolerance whose gaps are all within it is the answer.
    # From newton's default (1e-3) the first tolerances certify nothing on this case.
    splits = probe.cell_state_like((800, 200, 200), 64, scales="lognormal-2", noise=0.05)
    (X, y), Cs, chosen = splits[0], (0.25, 0.5, 1.0), [0.25, 1.0]
    monkeypatch.setattr(probe, "SOLVER_TIGHT_TOLS", tuple(10.0**-k for k in range(3, 11)))
    gaps: list[float] = []
    path = probe.newton.l1_logistic_path

    def watched(*args: Any, **kwargs: Any) -> Any:
        points = list(path(*args, **kwargs))  # a generator: read once here, handed on as a list
        gaps.append(
            max(
                probe.duality_gap(p.coef, p.intercept, X, y, p.C)
                / probe.objective(p.coef, p.intercept, X, y, p.C)
                for p in points
                if p.C in chosen
            )
        )
        return points

    monkeypatch.setattr(probe.newton, "l1_logistic_path", watched)
    tight = probe.tightened_newton(splits, Cs, chosen, "cpu")
    assert len(tight["tried"]) == len(gaps) >= 3 and tight["tried"] == list(
        probe.SOLVER_TIGHT_TOLS[: len(gaps)]
    )
    assert all(gap > 1e-8 for gap in gaps[:-1]) and gaps[-1] <= 1e-8  # the first that certifies, no further
    assert tight["tol"] == tight["tried"][-1] and max(p["duality_gap"] for p in tight["per_C"]) <= 1e-8
    line = probe.tightened_line(
        {
            "case": "c",
            "solver": "newton",
            "C": [0.25, 1.0],
            "per_C": [{"C": C, "objective": [1.0, 1.0]} for C in Cs],
        }
        | {"solver_tightened": tight},
        "solver_tightened",
    )
    earlier = ", ".join(f"{tol:g}" for tol in tight["tried"][:-1])
    assert (
        f"refitted at tol {tight['tol']:g} (its default 0.001; at {earlier} a duality gap was above 1e-08)"
        in line
    )


@pytest.mark.filterwarnings("ignore:bf16 features on a CPU")  # a CPU that emulates bf16: slower, same values
def test_real_cell_states_read_in_bf16_are_kept_apart_from_fp32_s(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--features-precision bf16``: the same trained model (trained once, cached), its SST cell states
    read in bf16 into a file of their own, near fp32's and not equal to them; the case says so."""
    cell_states = load_benchmark("cell_states.py", "cell_states_benchmark", monkeypatch)
    monkeypatch.setattr(cell_states, "SHARED_DATA", shared_data)
    fp32 = cell_states.real_cell_states("sst", cell_states.Training("tiny", 2), cache=tmp_path)
    bf16 = cell_states.real_cell_states(
        "sst", cell_states.Training("tiny", 2), cache=tmp_path, precision="bf16"
    )
    assert len(list(tmp_path.glob("*.pt"))) == 1 and len(list(tmp_path.glob("sst-*.npz"))) == 2
    for (X, y), (X16, y16) in zip(fp32, bf16, strict=True):
        assert (y == y16).all() and X.shape == X16.shape and not (X == X16).all()
        assert abs(X16 - X).max() <= 2e-2 * abs(X).max()
    probe = load_benchmark("probe.py", "probe_benchmark", monkeypatch)
    case = probe.parse_case("real-sst:64")
    assert probe.replace(case, precision="bf16").name == "real SST × 64 (tiny, bf16 features)"
    assert case.name == "real SST × 64 (tiny)"  # fp32's name, as recorded before


def test_real_cell_states_of_a_model_trained_on_imdb_unsup_are_cached_apart(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--train-text imdb-unsup``: a model of its own (its cache key names the training files), trained on
    IMDB's unlabelled reviews, so its cell states differ from the Amazon-trained model's; an unknown text
    is refused by name."""
    cell_states = load_benchmark("cell_states.py", "cell_states_benchmark", monkeypatch)
    monkeypatch.setattr(cell_states, "SHARED_DATA", shared_data)
    read: list[int] = []
    real_train = cell_states.train
    monkeypatch.setattr(
        cell_states, "train", lambda model, data, *a: (read.append(len(data)), real_train(model, data, *a))
    )
    amazon = cell_states.real_cell_states("sst", cell_states.Training("tiny", 2), cache=tmp_path)
    imdb = cell_states.real_cell_states("sst", cell_states.Training("tiny", 2, "imdb-unsup"), cache=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 2 and len(list(tmp_path.glob("sst-*.npz"))) == 2
    # IMDB's 50,000 unlabelled reviews are about 65 MB of text; the three Amazon files a few MB.
    assert read[0] < 10_000_000 < 60_000_000 < read[1]
    assert not np.array_equal(amazon[0][0], imdb[0][0])
    with pytest.raises(SystemExit, match="no training text 'wiki'; one of amazon, imdb-unsup"):
        cell_states.Training("tiny", 2, "wiki")


def test_a_real_sample_case_needs_no_shared_data_and_reads_the_demo_s_reviews_at_sst_s_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``real-sample`` with ``--train-text sample``: the demo's generated corpus is the training text and
    its labelled reviews the splits, both written into the cache, so the case runs without the shared
    data; its train split is SST's size, both labels in each split. ``sample`` is a real case's only."""
    cell_states = load_benchmark("cell_states.py", "cell_states_benchmark", monkeypatch)
    monkeypatch.setattr(cell_states, "SHARED_DATA", tmp_path / "no shared data")
    splits = cell_states.real_cell_states("sample", cell_states.Training("tiny", 2, "sample"), cache=tmp_path)
    train_X, train_y = splits[0]
    assert abs(len(train_y) - 6_920) <= 50 and train_X.shape[1] == 64
    assert all(set(y.tolist()) == {0, 1} for _, y in splits)
    assert len(list(tmp_path.glob("*.pt"))) == 1 and (tmp_path / "sample-corpus").is_dir()
    probe = load_benchmark("probe.py", "probe_benchmark", monkeypatch)
    assert probe.parse_case("real-sample:64").name == "real SAMPLE × 64 (tiny)"
    with pytest.raises(SystemExit, match="ROWS is one of sst, imdb"):
        probe.parse_case("sample:64")


def test_a_real_case_s_model_is_scored_on_held_out_text_and_its_training_recorded(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record says what the real case's model learned, computed, not read off its progress lines: its
    bits per byte on the dataset's dev texts and its training as ``train`` returned it; a model cached
    before its training was written says so rather than guess."""
    cell_states = load_benchmark("cell_states.py", "cell_states_benchmark", monkeypatch)
    monkeypatch.setattr(cell_states, "SHARED_DATA", shared_data)
    returned: list[dict[str, float]] = []
    real_train = cell_states.train
    monkeypatch.setattr(cell_states, "train", lambda *a: returned.append(real_train(*a)) or returned[-1])
    cell_states.real_cell_states("sst", cell_states.Training("tiny", 3), cache=tmp_path)
    learned = cell_states.what_it_learned("sst", cell_states.Training("tiny", 3), cache=tmp_path)
    assert (
        learned["training"] == returned[0] and returned[0]["last_steps"] == 3 and returned[0]["seconds"] > 0
    )
    dev = cell_states.load_dataset(f"sst2={shared_data / 'sst2'}").dev.texts
    assert learned["held_out_bytes"] == min(len(b"\n".join(cell_states.encode(t) for t in dev)), 1 << 18)
    # Three steps from random weights: near the 8 bits of a uniform guess, not at it.
    assert 5 < learned["held_out_bits_per_byte"] < 8.5
    tables = load_benchmark("tables_transfer.py", "tables_transfer_benchmark", monkeypatch)
    line = tables.learned_line({"case": "real SST × 64 (tiny)", "solver": "newton", "model": learned})
    assert f"reads {learned['held_out_bits_per_byte']} bits a byte on " in line
    assert "last 3 steps" in line
    next(tmp_path.glob("*.json")).unlink()  # as a model cached before the record kept its training
    again = cell_states.what_it_learned("sst", cell_states.Training("tiny", 3), cache=tmp_path)
    assert again["training"] is None and again["held_out_bits_per_byte"] == learned["held_out_bits_per_byte"]
    assert "its training was not recorded" in tables.learned_line(
        {"case": "c", "solver": "s", "model": again}
    )


def test_a_rank_case_builds_features_near_a_manifold_of_that_rank(probe: ModuleType) -> None:
    case = probe.parse_case("sst:256:lognormal-1:0.05:8")
    assert case.name == "sst-sized × 256, rank-8 latent, lognormal-1 scales, noise 0.05"
    (X, y), dev, test = probe.features_of(case, None)
    assert [len(X), len(dev[0]), len(test[0])] == list(probe.ROWS["sst"])
    # Standardised, 8 directions hold nearly all the variance; the 64-factor case spreads it wider.
    share = {}
    for spec in ("sst:256:lognormal-1:0.05:8", "sst:256:lognormal-1:0.05"):
        X = probe.features_of(probe.parse_case(spec), None)[0][0][:2000]
        power = np.linalg.svd((X - X.mean(0)) / X.std(0), compute_uv=False) ** 2
        share[spec] = power[:8].sum() / power.sum()
    assert share["sst:256:lognormal-1:0.05:8"] > 0.9 > 0.5 > share["sst:256:lognormal-1:0.05"], share
    assert 0.3 < y.mean() < 0.7  # labels from the latent: both classes


@pytest.mark.parametrize(
    "spec", ["sst:64:lognormal-1:0.05:0", "sst:64:lognormal-1:0.05:x", "real-sst:64:::8"]
)
def test_a_bad_rank_is_refused_naming_the_case(probe: ModuleType, spec: str) -> None:
    with pytest.raises(SystemExit, match=f"--cases: '{spec}'.*RANK"):
        probe.parse_case(spec)


@pytest.mark.parametrize(
    ("flag", "offers"), [("--train-text", "TRAINING_TEXTS"), ("--train-precision", "PRECISIONS")]
)
def test_a_real_case_s_training_flags_offer_what_cell_states_can_do(
    probe: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    offers: str,
) -> None:
    """``--train-text``'s and ``--train-precision``'s choices are listed by hand (cell_states is imported
    only by a run with real cases): they are cell_states' own, no more and no fewer."""
    cell_states = load_benchmark("cell_states.py", "cell_states_benchmark", monkeypatch)
    monkeypatch.setattr(sys, "argv", ["probe.py", flag, "?"])
    with pytest.raises(SystemExit):
        probe.main()
    offered = re.search(r"invalid choice: '\?' \(choose from (.*)\)", capsys.readouterr().err)
    assert offered is not None
    assert [choice.strip("'") for choice in offered[1].split(", ")] == list(getattr(cell_states, offers))


def test_a_model_trained_in_bf16_is_a_model_of_its_own_and_its_record_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--train-precision bf16``: every training step runs under bf16's autocast, the model is cached
    apart from the fp32 one (whose cache name is unchanged: fp32 stays out of the hash), its cell states
    differ, and what it learned says how it was trained; an unknown precision is refused by name."""
    cell_states = load_benchmark("cell_states.py", "cell_states_benchmark", monkeypatch)
    monkeypatch.setattr(cell_states, "SHARED_DATA", tmp_path / "no shared data")
    dtypes: list[torch.dtype] = []
    real_step = cell_states.optimizer_step

    def step(*args: Any, dtype: torch.dtype, **kwargs: Any) -> Any:
        dtypes.append(dtype)
        return real_step(*args, dtype=dtype, **kwargs)

    monkeypatch.setattr(cell_states, "optimizer_step", step)
    in_fp32, in_bf16 = (
        cell_states.Training("tiny", 2, "sample", precision) for precision in ("fp32", "bf16")
    )
    fp32 = cell_states.real_cell_states("sample", in_fp32, cache=tmp_path)
    bf16 = cell_states.real_cell_states("sample", in_bf16, cache=tmp_path)
    assert dtypes == [torch.float32] * 2 + [torch.bfloat16] * 2
    assert len(list(tmp_path.glob("tiny-*.pt"))) == 2 and not np.array_equal(fp32[0][0], bf16[0][0])
    # The name an fp32 model had before bf16 was offered (computed by that code, for these settings).
    (tmp_path / "corpus.txt").write_bytes(b"x" * 1000)
    old = cell_states.cached_model(
        Path("/cache"), cell_states.Training("small", 400), [tmp_path / "corpus.txt"]
    )
    assert old.name == "small-bb13605d0786ca62.pt"
    learned = cell_states.what_it_learned("sample", in_bf16, cache=tmp_path)
    assert learned["precision"] == "bf16" and 0 < learned["held_out_bits_per_byte"] < 8.5
    tables = load_benchmark("tables_transfer.py", "tables_transfer_benchmark", monkeypatch)
    assert "2 steps on sample under bf16 autocast) reads" in tables.learned_line(
        {"case": "c", "solver": "s", "model": learned}
    )
    with pytest.raises(SystemExit, match="no training precision 'fp16'; one of fp32, bf16"):
        cell_states.Training("tiny", 2, "sample", "fp16")
