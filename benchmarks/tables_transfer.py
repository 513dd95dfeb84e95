"""The tables of the transfer-side benchmarks on docs/benchmarks.md: scoring, the probe, the TF-IDF
baseline, the sentiment neuron, fine-tuning (``render.TABLES`` maps a record's benchmark to its
function)."""

from __future__ import annotations

import math
from typing import Any

from common import TIGHTENED, describe, probe_goal_misses, tightened_line
from table_format import fixed_cost_table, num, percent, ratio, table


def score_tables(results: dict[str, Any]) -> str:
    settings, checks = results["settings"], results["checks"]
    rows = [
        [
            run["name"],
            num(run["seconds"])
            + (f" ({', '.join(num(x) for x in run['each_seconds'])})" if run.get("each_seconds") else ""),
            num(run.get("flow_seconds")),
            num(run["rows_per_s"]),
            num(run["chars_per_s"]),
            ratio(run["ratio_vs_features"]),
            f"{run['peak_rss'] / 2**30:.2f} GiB" if run.get("peak_rss") else "",
        ]
        for run in results["runs"]
    ]
    load = results["load_average"]
    memory, g = results["memory"], settings["grow"]

    def grown(key: str) -> str:  # the peak at the larger input, where the run had one
        return f", {g}× {memory[f'{g}x{key}'] / 2**30:.2f} GiB" if "memory_growth" in checks else ""

    lines = [
        f"{settings['rows']:,} IMDB test reviews ({settings['chars']:,} characters)"
        + (
            " as one `.csv.gz` for `score` (read by windows through its seek-point index)"
            if settings.get("gzip")
            else ""
        )
        + f", {settings['preset']} model"
        + (
            f" (features and `predict --input` in {settings['precision']})"
            if settings.get("precision")
            else ""
        )
        + f", {settings['workers']} workers, pieces of {settings['piece_rows']} rows; load average "
        f"{load['before']:.1f} before, {load['after']:.1f} after."
        + (
            f" The features path, the pool and Dask ran {repeats} times each, interleaved: seconds are"
            " the median (each run's in brackets, in order), rows/s and the ratios are of the median;"
            " peak RSS is the largest of the runs."
            if (repeats := settings.get("repeats", 1)) > 1
            else ""
        ),
        "",
        table(["run", "seconds", "flow s", "rows/s", "chars/s", "÷ features", "peak RSS"], rows),
        "",
        f"score ÷ features path {checks['score_vs_features']:.2f} (goal ≥ 0.8); score ÷ predict "
        f"{checks['score_vs_predict']:.2f}"
        + (
            f"; Dask ÷ process pool {checks['dask_vs_process_pool']:.2f} (goal within 10 %)"
            if "dask_vs_process_pool" in checks
            else ""
        )
        + f". Peak RSS (process and workers) 1× {memory['1x'] / 2**30:.2f} GiB{grown('')}"
        + (
            f": {checks['memory_growth']:.2f}× (goal within 1.10×)."
            if "memory_growth" in checks
            else " (no larger input in this run)."
        ),
    ]
    if "1x_own" in memory:
        lines[-1] += (
            f" Of which this process 1× {memory['1x_own'] / 2**30:.2f} GiB{grown('_own')};"
            f" the largest other (a worker, or Prefect's server) 1× {memory['1x_largest_other'] / 2**30:.2f} GiB"
            f"{grown('_largest_other')}."
        )
    each = [
        f"{label} {', '.join(f'{v:.2f}' for v in checks[key])}"
        for key, label in [
            ("score_vs_features_each", "score ÷ features"),
            ("dask_vs_process_pool_each", "Dask ÷ pool"),
        ]
        if key in checks
    ]
    if each:
        lines[-1] += f" Each repeat's own ratios: {'; '.join(each)}."
    return "\n".join(lines)


def score_fixed_tables(results: dict[str, Any]) -> str:
    settings, ratios, load = results["settings"], results["ratios"], results["load_average"]
    return (
        f"{settings['rows']} IMDB test reviews, the {settings['preset']} classifier, each case "
        f"{settings['repeat']} times (the fastest kept); 1-minute load average {load['before']:.1f} at the "
        f"start, {load['after']:.1f} at the end.\n\n"
        + fixed_cost_table(results["rows"])
        + f"\n\n`score` took {ratios['score_vs_predict']:.2f}× `predict --input`'s time; the flow of one piece on a "
        f"thread {ratios['thread_vs_process_pool']:.2f}× its time on a process pool.\n"
    )


def source_path(results: dict[str, Any]) -> str | None:
    """Where liblinear's sweeps came from when not run in the same run (``--liblinear-from``)."""
    return (results.get("liblinear_source") or {}).get("path")


def objective_gap(objectives: list[float] | None) -> str:
    """The solver's objective above liblinear's, relative (> 0: it stopped higher); blank if unknown."""
    if not objectives or not math.isfinite(objectives[0]) or objectives[0] == 0:
        return ""
    return f"{(objectives[1] - objectives[0]) / abs(objectives[0]):+.1e}"


def learned_line(row: dict[str, Any]) -> str:
    """What a real case's model learned, as the run measured it (records before kept none)."""
    model, training = row["model"], row["model"]["training"]
    trained = (
        f"it trained in {num(training['seconds'])} s, {training['last_loss_bits_per_byte']} bits a byte over its "
        f"last {training['last_steps']} steps"
        if training
        else "its training was not recorded (the model was cached before it was)"
    )
    # Records before --train-precision kept no precision: their models trained in fp32.
    precision = model.get("precision", "fp32")
    under = "" if precision == "fp32" else f" under {precision} autocast"
    return (
        f"{row['case']}, {row['solver']}: the model ({model['preset']}, {model['steps']:,} steps on "
        f"{model['text']}{under}) reads {model['held_out_bits_per_byte']} bits a byte on {model['held_out_bytes']:,} "
        f"bytes of {model['held_out']} texts, which it never trained on; {trained}."
    )


def probe_tables(results: dict[str, Any]) -> str:
    Cs = results["Cs"]
    rows = [
        [
            r["case"],
            r.get("solver", "torch"),  # records from before newton had torch only
            num(r["liblinear_s"]),
            num(r.get("solver_s", r.get("torch_s"))),
            # A speed-up only where both sweeps ran in this run: one against another run's is not a ratio.
            "(other runs)" if source_path(results) else ratio(r["speedup"]),
            f"{r['C'][0]:g}, {r['C'][1]:g}",
            f"{r['dev_accuracy'][0]}, {r['dev_accuracy'][1]}",
            f"{r['test_accuracy'][0]}, {r['test_accuracy'][1]}",
            str(r["max_dev_gap_points"]),
            # Records from before objectives and memory were kept have neither.
            "" if r.get("max_objective_gap") is None else f"{r['max_objective_gap']:+.1e}",
            ", ".join("" if m is None else f"{m / 2**30:.2f} GiB" for m in r.get("peak_rss", [])),
        ]
        for r in results["rows"]
    ]
    header = ["case", "solver", "liblinear s", "solver s", "speed-up", "C (lib, solver)"]
    header += ["dev acc (lib, solver)", "test acc (lib, solver)", "max dev gap over C (points)"]
    header += ["max objective gap", "peak RSS (lib, solver)"]
    parts = [f"{len(Cs)} values of C, {min(Cs):g} … {max(Cs):g}.", table(header, rows)]
    if warm := results.get("warm_up_s"):  # records from before the warm-up have none
        parts.insert(
            1,
            "Each solver's first fit in the process (400 train rows × 256, the two largest values of C), which loads "
            "what later fits reuse, is left out of the rows: "
            + ", ".join(f"{solver} {num(seconds)} s" for solver, seconds in warm.items())
            + ".",
        )
    verdicts = [
        (r["case"], r["goal"]) for r in results["rows"] if r.get("solver") == "newton" and "goal" in r
    ]
    if verdicts and not source_path(results):
        failed = probe_goal_misses(verdicts)
        applies = [case for case, goal in verdicts if goal["speedup"] is not None]
        parts.append(
            "Goal (issue 27): newton ≥ 10× liblinear on SST-sized and ≥ 5× on IMDB-sized cases at 4,096 "
            "features, the same C or a dev tie, test within 0.5 point, no objective above liblinear's at any "
            f"C; the speed-up applies to {'; '.join(applies) or 'no case of this run'}: "
            + ("met." if not failed else f"not met for {'; '.join(failed)}.")
        )
    parts += [tightened_line(r, key) for r in results["rows"] for key in TIGHTENED if key in r]
    parts += [learned_line(r) for r in results["rows"] if "model" in r]
    source = results.get("liblinear_source") or {}
    if source_path(results):  # --liblinear-from: the baseline ran elsewhere, earlier
        parts.insert(
            1,
            f"liblinear was not run here: its sweeps are those recorded in `{source['path']}` "
            f"({source['date']}, {describe(source['machine'])}), so no speed-up is shown: the two "
            "times are of different runs.",
        )
    goal = results.get("goal") or {}
    if goal.get("applies"):
        verdict = "met" if goal["met"] else "not met"
        parts.append(
            f"Goal: the {goal['case']} {goal['solver']} sweep in at most {goal['goal_s']:g} s on a GPU: "
            f"{goal['seconds']} s, {verdict}."
        )
    for r in results["rows"]:
        if "per_C" not in r:  # records from before the per-C times
            continue
        per_C = [
            [
                f"2^{math.log2(p['C']):g}",
                num(p["seconds"][0]),
                num(p["seconds"][1]),
                f"{p['dev_accuracy'][0]}, {p['dev_accuracy'][1]}",
                f"{p['nonzero'][0]}, {p['nonzero'][1]}",
                objective_gap(p.get("objective")),
            ]
            for p in r["per_C"]
        ]
        parts.append(f"Per C, {r['case']}, {r['solver']} (seconds from the previous C's end):")
        header = ["C", "liblinear s", "solver s", "dev acc (lib, solver)", "non-zero (lib, solver)"]
        parts.append(table([*header, "objective gap"], per_C))
    return "\n\n".join(parts)


def baseline_tables(results: dict[str, Any]) -> str:
    rows = [
        [
            r["dataset"],
            " / ".join(f"{r['rows'][split]:,}" for split in ("train", "dev", "test")),
            r["dev_rule"],
            percent(r["test_accuracy"]),
            percent(r["dev_accuracy"]),
            f"{r['C']:g}",
            num(r["seconds"]),
            f"{r['peak_rss_gib']:.1f} GiB",
        ]
        for r in results["rows"]
    ]
    header = [
        "dataset",
        "rows (train / dev / test)",
        "dev",
        "test acc",
        "dev acc",
        "C",
        "seconds",
        "peak RSS",
    ]
    sweeps = [
        f"- {r['dataset']} dev accuracy by C: "
        + ", ".join(f"{p['C']:g}: {percent(p['dev_accuracy'])}" for p in r["sweep"])
        for r in results["rows"]
    ]
    return table(header, rows) + "\n\n" + "\n".join(sweeps)


def neuron_tables(results: dict[str, Any]) -> str:
    means = results.get("class_means")
    lines = [
        f"`{results['model']}`, unit {results['unit']}"
        + (
            f" (class means on the probe's training features: negative {means['negative']:.3g}, "
            f"positive {means['positive']:.3g})"
            if means
            else ""
        )
        + f"; {results['samples']} samples of {results['length']} bytes each side, temperature "
        f"{results['temperature']:g}, seed {results['seed']}, prompt {results['prompt']!r}.",
        "",
    ]

    def cell(s: dict[str, Any]) -> str:
        spread = f" ± {s['stderr']:.3f}" if s.get("stderr") is not None else ""
        return f"{s['mean_probability']:.3f}{spread} (min {s['min_probability']:.3f}, max {s['max_probability']:.3f})"

    rows = [
        [
            "`generate --sentiment`" if row["held"] == "generate" else row["held"],
            f"{row['positive']['value']:+.3g}, {row['negative']['value']:+.3g}",
            cell(row["positive"]),
            cell(row["negative"]),
            f"{row['gap']:+.3f}",
        ]
        for row in results["rows"]
    ]
    header = ["held", "value (positive, negative)", "mean P(positive), held positive"]
    header += ["mean P(positive), held negative", "gap"]
    return "\n".join([*lines, table(header, rows)])


def finetune_tables(results: dict[str, Any]) -> str:
    settings = results["settings"]
    described = ", ".join(f"{k} {v}" for k, v in settings.items())
    rows = [
        [
            r["dataset"],
            " / ".join(f"{r['rows'][split]:,}" for split in ("train", "dev", "test")),
            percent(r["finetune_test_accuracy"]),
            percent(r["probe_test_accuracy"]),
            percent(r["baseline_test_accuracy"]),
            f"{num(r['finetune_seconds'])}"
            # Records from before the job timed its read of test have no figure for it.
            + (
                f" (test {num(r['finetune_test_seconds'])})"
                if r.get("finetune_test_seconds") is not None
                else ""
            )
            + f" / {num(r['probe_seconds'])} / {num(r['baseline_seconds'])}",
            f"{r['finetune_best_epoch']} ({percent(r['finetune_dev_accuracy'])})",
        ]
        for r in results["rows"]
    ]
    header = [
        "dataset",
        "rows (train / dev / test)",
        "fine-tuned",
        "probe",
        "TF-IDF",
        "seconds (fine-tuning / probe / TF-IDF)",
        "best epoch (dev)",
    ]
    parts = [f"From {results['checkpoint']}; fine-tuning settings: {described}.", table(header, rows)]
    for r in results["rows"]:
        epochs = [
            [
                str(e["epoch"]),
                num(e["train_loss"]),
                num(e["aux_lm_loss"]),
                percent(e["dev_accuracy"]),
                num(e["lr"]),
            ]
            for e in r["epochs"]
        ]
        parts.append(f"Per epoch, {r['dataset']}:")
        parts.append(table(["epoch", "train loss", "LM loss (nats)", "dev acc", "lr"], epochs))
    speeds = [
        [s["preset"], str(s["batch_size"]), num(s["finetune_chars_per_s"]), num(s["pretrain_chars_per_s"]),
         ratio(s["finetune_vs_pretrain"]),
         " / ".join(percent(s[k]) if k in s else "–" for k in ("padding", "padding_random"))]
        for s in results["speeds"]
    ]  # fmt: skip
    header = [
        "preset",
        "batch",
        "fine-tuning chars/s",
        "pretraining chars/s",
        "ratio",
        "padding (job's / random batches)",
    ]
    if speeds:
        parts.append(table(header, speeds))
    return "\n\n".join(parts)


def tuning(settings: dict[str, Any]) -> str:
    return f"{settings['pool']} pooling, lr {settings['lr']:g}, aux LM weight {settings['aux_lm_weight']:g}"


def finetune_select_tables(results: dict[str, Any]) -> str:
    """The candidates by dev accuracy only; test appears once, for the chosen settings."""
    from tasks.finetune.config import FinetuneSettings

    chosen = next(c for c in results["candidates"] if c["name"] == results["chosen"])
    rows = [
        [
            c["name"] + (" (chosen)" if c is chosen else ""),
            c["settings"]["pool"],
            f"{c['settings']['lr']:g}",
            f"{c['settings']['aux_lm_weight']:g}",
            percent(c["dev_accuracy"]),
            str(c["best_epoch"]),
            num(c["seconds"]),
        ]
        for c in results["candidates"]
    ]
    header = ["candidate", "pooling", "lr", "aux LM weight", "dev acc", "best epoch", "seconds"]
    run = results["chosen_run"]
    now = {key: FinetuneSettings.model_fields[key].default for key in chosen["settings"]}
    described = ", ".join(f"{k} {v}" for k, v in results["settings"].items())
    return "\n\n".join(
        [
            f"From {results['checkpoint']}; each candidate on {results['rows']['train']:,} train rows (a fixed "
            f"subset) and dev's {results['rows']['dev']:,}, with dev in test's place; the other settings: "
            f"{described}. The rule: {results['rule']}.",
            table(header, rows),
            f"Chosen on dev: {chosen['name']} ({tuning(chosen['settings'])}). Fine-tuned so on all "
            f"{run['rows']['train']:,} train rows, its one test figure: {percent(run['finetune_test_accuracy'])} "
            f"(dev {percent(run['finetune_dev_accuracy'])}, best epoch {run['finetune_best_epoch']}); from the "
            f"same checkpoint the frozen probe {percent(run['probe_test_accuracy'])} and TF-IDF "
            f"{percent(run['baseline_test_accuracy'])} on test. The command's default when this ran: "
            f"{tuning(results['default_when_run'])}; now: {tuning(now)}"
            + (", the chosen." if now == chosen["settings"] else ", not the chosen."),
        ]
    )
