"""The tables of the pipeline's build-side benchmarks on docs/benchmarks.md: corpus, pretraining, its jobs
and GPU checks, the pipeline and its weekly run, sweeps, the CLI (``render.TABLES`` maps a record's
benchmark to its function)."""

from __future__ import annotations

import math
from typing import Any

from common import precision_line
from table_format import MIB, fixed_cost_table, num, percent, ratio, table


def corpus_tables(results: dict[str, Any]) -> str:
    source = results["input"]
    lines = [
        f"Input: {source['bytes'] / 1e6:,.1f} MB uncompressed, {source['records']:,} records "
        f"({'gzip' if source['gzip'] else 'plain'}), {source['copies']} cop"
        f"{'y' if source['copies'] == 1 else 'ies'} of the shared files.",
        "",
    ]
    rows = [
        [
            row["name"],
            num(row["seconds"]),
            num(row["cpu_seconds"]),
            num(row["mb_per_s"]),
            ratio(row["ratio_vs_floor"]),
            f"{row['peaks']['tree'] / 2**30:.2f} GiB",
            f"{row['peaks']['tree_anon'] / 2**30:.2f} GiB",
            f"{row['peaks']['process'] / 2**30:.2f} GiB",
        ]
        for row in results["rows"]
    ]
    header = ["row", "seconds", "CPU s", "MB/s", "vs floor", "peak RSS tree", "anon", "1 process"]
    lines.append(table(header, rows))
    goal = results["goal"]
    lines += [
        "",
        f"Full build (flow) against the floor: {goal['ratio']:.0%} (against the pyarrow-defaults floor: "
        f"{goal['ratio_vs_pyarrow_defaults']:.0%}); checks failed: {len(results['checks_failed'])}.",
    ]
    return "\n".join(lines)


def corpus_delta_tables(results: dict[str, Any]) -> str:
    source = results["input"]
    lines = [
        f"Input: {source['base_bytes'] / 1e6:,.1f} MB base + {source['delta_bytes'] / 1e6:,.1f} MB delta "
        f"(plain JSON lines, {source['files']} files).",
        "",
    ]
    rows = [
        [row["name"], num(row["seconds"]), str(row["pieces"]), str(row["buckets"]), f"{row['peak_rss_tree'] / 2**30:.2f} GiB"]
        for row in results["rows"]
    ]  # fmt: skip
    lines.append(table(["row", "seconds", "pieces", "buckets", "peak RSS tree"], rows))
    goal = results["goal"]
    kept = results["rows_kept"]
    lines += [
        "",
        f"Delta build against full build: {goal['delta_vs_full_time']:.1%} of the time (goal "
        f"{goal['time_goal']:.0%}), {goal['delta_vs_full_peak_rss']:.2f}× the peak RSS; rows kept "
        f"{kept['grown']:,} grown, {kept['full']:,} full ({results['delta_rows']:,} from the delta); checks "
        f"failed: {len(results['checks_failed'])}.",
        "",
        "One 73 KB file (Appliances_5.json.gz):",
        "",
        fixed_cost_table(results["fixed_cost"]),
    ]
    return "\n".join(lines)


def pretrain_tables(results: dict[str, Any]) -> str:
    peaks = ", ".join(
        f"{name} {flops / 1e9:,.1f} GFLOP/s" for name, flops in results["matmul_peak_flops"].items()
    )
    settings = results["settings"]
    rows = []
    for row in results["rows"]:
        steps = row["step_seconds"]
        loss = (
            f"{row['first_loss']:.3f} → {row['last_loss']:.3f}"
            if row["first_loss"] is not None and row["last_loss"] is not None
            else ""
        )
        rows.append(
            [
                row["preset"],
                row["impl"],
                f"{row['num_params'] / 1e6:.4g}M",
                f"{row['batch']} × {row['seq_len']}",
                row["precision"],
                str(len(steps)),
                num(sum(steps) / len(steps)) if steps else row["status"],
                num(row["chars_per_s"]),
                percent(row["mfu"]),
                ratio(row["vs_reference"]),
                ratio(row["vs_baseline"]),
                num(row["vs_paper"]),
                f"{row['peak_memory_bytes'] / 2**30:.2f} GiB",
                f"{row['planned_allocated_bytes'] / 2**30:.2f} GiB"
                if row.get("planned_allocated_bytes")
                else "",
                loss,
            ]
        )
    header = [
        "preset",
        "code",
        "params",
        "batch × seq",
        "precision",
        "timed steps",
        "s/step (mean)",
        "chars/s",
    ]
    header += [
        "MFU",
        "vs reference",
        "vs baseline",
        "vs paper",
        "peak memory",
        "planned",
        "first → last loss",
    ]
    lines = [
        f"Matmul peak ({settings['matmul_size']}³, measured in the same run): {peaks}. "
        f"Checks failed: {len(results['checks_failed'])}.",
        "",
        table(header, rows),
    ]
    return "\n".join(lines)


def sharding_tables(results: dict[str, Any]) -> str:
    rows = []
    for row in results["rows"]:
        base = next(
            r
            for r in results["rows"]
            if r["preset"] == row["preset"] and r.get("batch") == row.get("batch") and r["sharding"] == "none"
        )
        rows.append(
            [
                row["preset"],
                row["sharding"],
                str(row["ranks"]),
                num(row["step_s"] * 1e3),
                ratio(row["step_s"] / base["step_s"]),
                num(row["peak_bytes"] / MIB),
                num(row["weight_bytes"] / MIB),
                num(row["optimizer_bytes"] / MIB),
                ratio(row["optimizer_bytes"] / base["optimizer_bytes"]),
            ]
        )
    header = ["preset", "sharding", "ranks", "step ms", "step vs DDP", "peak MiB/rank", "weights MiB/rank"]
    header += ["Adam MiB/rank", "Adam vs DDP"]
    return table(header, rows)


def features_tables(results: dict[str, Any]) -> str:
    rows = [
        [
            row["preset"],
            row["precision"],
            f"{row['texts']:,}",
            f"{row['rows']} × {row['steps']:,}, {row['idle']:.1%}" if "idle" in row else "–",
            f"{row['padding']:.1%}",
            num(row["chars_per_s"]),
            num(row["reference_chars_per_s"]),
            ratio(row["vs_reference"]),
            f"{row['baseline_texts']:,}",
            num(row["baseline_chars_per_s"]),
            ratio(row["ratio"]),
            f"{row['max_rel_diff']:.1e}",
        ]
        for row in results["features"]
    ]
    header = ["preset", "precision", "texts", "packed: rows × steps, idle", "reference padding", "chars/s"]
    header += ["reference chars/s", "vs reference"]
    header += ["baseline texts", "baseline chars/s", "vs baseline", "max rel diff"]
    lines = [f"Texts: {results['texts_source']}; {results['weights']}.", "", table(header, rows)]
    for row in results["features"]:
        if row.get("vs_first_precision") is not None:
            first = next(r for r in results["features"] if r["preset"] == row["preset"])
            lines += ["", precision_line(row, first)]
    if results["serving"]:
        # The precision column only where a run timed another than auto (records before it had none).
        precisions = any(row.get("precision", "auto") != "auto" for row in results["serving"])
        serving = [
            [
                row["preset"],
                *([row.get("precision", "auto")] if precisions else []),
                str(row["batch"]),
                str(row["requests"]),
                num(row["p50_ms"]),
                num(row["p99_ms"]),
                num(row["mean_ms"]),
                num(row["per_text_ms"]),
            ]
            for row in results["serving"]
        ]
        header = ["served preset", *(["precision"] if precisions else []), "texts/request", "requests"]
        header += ["p50 ms", "p99 ms", "mean ms", "p50 ms/text"]
        lines += ["", table(header, serving)]
    else:
        lines += ["", "Serving was not timed in this run (`--no-serve`)."]
    return "\n".join(lines)


def scaling_tables(results: dict[str, Any]) -> str:
    model = results["model"]
    gpus = model["nodes"] * model["gpus_per_node"]
    rows = [
        ["preset", f"{model['preset']} ({model['num_params']:,} parameters)"],
        ["GPUs", f"{gpus} ({model['nodes']} × {model['gpus_per_node']})"],
        ["step on one GPU", f"{model['step_seconds'] * 1e3:.1f} ms ({model['step_source']})"],
        ["all-reduce bytes per GPU per step", f"{model['allreduce_bytes'] / 1e6:,.0f} MB"],
        ["NVLink (reduce-scatter + all-gather)", f"{model['nvlink_seconds'] * 1e3:.2f} ms"],
        ["InfiniBand (all-reduce of 1/8 across nodes)", f"{model['infiniband_seconds'] * 1e3:.2f} ms"],
        ["all-reduce in all", f"{model['allreduce_seconds'] * 1e3:.2f} ms"],
        ["share that can overlap the backward (read-out)", f"{model['overlappable_share']:.1%}"],
        ["exposed communication", f"{model['exposed_seconds'] * 1e3:.2f} ms"],
        ["expected efficiency", f"{model['efficiency']:.1%}"],
        [f"speed-up on {gpus} GPUs", f"{model['speedup']:.0f}×"],
        ["Puri et al. 2018, 128 V100s (cited from the paper)", f"{model['paper_efficiency']:.0%}"],
    ]
    return table(["quantity", "value"], rows)


def pipeline_tables(results: dict[str, Any]) -> str:
    settings = results["settings"]
    rows = [
        [
            run["run"],
            num(run["seconds"]),
            f"{run['ratio']:.1f}×",
            ", ".join(f"{stage} {state}" for stage, state in run["stages"].items()),
        ]
        for run in results["runs"]
    ]
    return "\n".join(
        [
            f"A {settings['reviews']:,}-review sample, tiny mLSTM {settings['steps']} steps.",
            "",
            table(["run", "seconds", "first ÷ run", "stages"], rows),
        ]
    )


def weekly_tables(results: dict[str, Any]) -> str:
    settings = results["settings"]
    rows = [
        [row["stage"], num(row["full_s"]), num(row["weekly_s"]), f"{row['ratio']:.2f}×"]
        for row in results["stages"]
    ]
    weekly = results["runs"][1]
    trained = [
        [run["run"], f"{run['rows']:,}", str(run["steps"]), "" if run["val_bpc"] is None else f"{run['val_bpc']:.3f}"]
        for run in results["runs"]
    ]  # fmt: skip
    return "\n".join(
        [
            f"Base: {', '.join(f'`{name}`' for name in settings['base'])}; the week's new file: "
            f"`{settings['new']}`, a delta of {results['delta_rows']:,} rows of {weekly['rows']:,}. Tiny, "
            f"{settings['steps']} steps from scratch against {settings['continued_steps']} continued "
            f"(replay {settings['replay']:g}); the weekly home's set-up run took "
            f"{num(results['setup_seconds'])} s. {results['notes']}.",
            "",
            table(["stage", "(a) full, s", "(b) weekly, s", "(b) ÷ (a)"], rows),
            "",
            table(["run", "corpus rows", "steps trained", "val bpc (the same val split)"], trained),
        ]
    )


def continue_tables(results: dict[str, Any]) -> str:
    rows = results["rows"]
    first = {row["case"]: row for row in rows}
    base, scratch, forgetful = rows[0], rows[1], rows[-1]
    chosen = first[results.get("chosen", rows[2]["case"])]  # a record before the grid: its one (b)
    grid = [r for r in rows if r["case"].startswith("(b)")]
    body = [
        [r["case"], str(r["steps"]), num(r["seconds"], 1), ratio(r["seconds"] / scratch["seconds"]),
         f"{r['val_bpb']['full']:.4f}", f"{r['val_bpb']['delta']:.4f}", f"{r['val_bpb']['base']:.4f}"]
        + ([f"{r['fresh_passes']:.2f}"] if "fresh_passes" in r else [])
        for r in rows
    ]  # fmt: skip
    passes = ["passes over its fresh train text"] if "fresh_passes" in rows[0] else []  # newer records'
    train = results.get("train_bytes")
    text_share = f", {train['delta'] / train['full']:.1%} of the grown corpus's train text" if train else ""
    goal = results["goal"]
    met = goal["bpb_ratio"] <= 1.02 and goal["steps_ratio"] <= 0.15
    forgets = [
        f"{r['case']} {r['val_bpb']['base'] - base['val_bpb']['base']:+.3f}"
        for name, r in first.items()
        if name.startswith(("(b)", "(c)"))
    ]
    settings = results["settings"]
    continued = settings.get("continued_lr")
    if isinstance(continued, list):  # a grid's records: one rate or several
        continued = ", ".join(f"{lr:g}" for lr in continued)
    elif continued:
        continued = f"{continued:g}"
    which = "(b)"
    choice = ""
    if len(grid) > 1:
        which = "the chosen (b)"
        choice = (
            f"\n\n(b) ran once for each replay share and rate, each from the base run's checkpoint; the one with "
            f"the lowest bits per byte on the full val split (the dev data) is chosen: {chosen['case']}, and (c) "
            f"runs at its rate."
        )
    tested = [r for r in rows if "test_bpb" in r]
    tests = ""
    if tested:
        tests = (
            f"\n\nThe test splits, read once at the end by the runs the goal compares (full "
            f"{results['test_bytes']['full']:,} bytes, delta {results['test_bytes']['delta']:,}, base "
            f"{results['test_bytes']['base']:,}):\n\n"
            + table(
                ["run", "full test bpb", "delta test bpb", "base test bpb"],
                [
                    [r["case"], *(f"{r['test_bpb'][split]:.4f}" for split in ("full", "delta", "base"))]
                    for r in tested
                ],
            )
            + f"\n\n{which[0].upper()}{which[1:]} against (a) on the full test split: {goal['test_bpb_ratio']:.4f} × its bits per byte."
        )
    return (
        f"{settings.get('preset', 'tiny')}, {settings['batch']} rows × {settings['seq_len']} bytes, lr {settings['lr']:g}"
        f"{f' ((b) and (c): {continued})' if continued else ''}; the delta is "
        f"`{settings['delta']}` ({settings['source_bytes']['delta'] / sum(settings['source_bytes'].values()):.1%} "
        f"of the sources' bytes{text_share}). Val splits read whole: full {results['val_bytes']['full']:,} bytes, delta "
        f"{results['val_bytes']['delta']:,}, base {results['val_bytes']['base']:,}.\n\n"
        + table(
            [
                "run",
                "steps",
                "seconds",
                "× (a)'s seconds",
                "full val bpb",
                "delta val bpb",
                "base val bpb",
                *passes,
            ],
            body,
        )
        + choice
        + f"\n\n{which[0].upper()}{which[1:]} against (a) on the full val split: {goal['bpb_ratio']:.4f} × its bits per byte at "
        f"{goal['steps_ratio']:.0%} of its steps (goal: ≤ 1.02 at ≤ 15%): {'met' if met else 'not met'}. "
        f"On the base's val split, against the base run: {', '.join(forgets)} bits per byte; without replay "
        f"{forgetful['val_bpb']['base'] - chosen['val_bpb']['base']:+.4f} against {'the chosen (b)' if choice else 'with it'} (what (c) forgets). "
        f"On the delta's: {chosen['val_bpb']['delta'] - scratch['val_bpb']['delta']:+.3f} and "
        f"{forgetful['val_bpb']['delta'] - scratch['val_bpb']['delta']:+.3f} against (a)." + tests + "\n"
    )


def sweep_tables(results: dict[str, Any]) -> str:
    arms = {"asha": "ASHA", "random": "random search", "pruner": "Optuna pruner"}
    header = ["seed", "workers", "arm", "steps", "× random's steps", "seconds", "best val_bpc"]
    header += ["vs random's best", "best trial"]
    rows = []
    for r in results["rows"]:
        for key, name in arms.items():
            arm = r[key]
            rows.append(
                [
                    str(r["seed"]),
                    str(r["workers"]),
                    name,
                    str(arm["steps"]),
                    f"{arm['steps_vs_random']:.2f}",
                    num(arm["seconds"]),
                    f"{arm['best']:.4f}",
                    f"{arm['best_vs_random']:+.2%}",
                    str(arm["best_trial"]),
                ]
            )
    lines = [
        f"Rungs {results['rows'][0]['rungs']}, η {results['settings']['eta']}, "
        f"{results['settings']['trials']} trials.",
        "",
        table(header, rows),
        "",
    ]
    for count in sorted({r["workers"] for r in results["rows"]}):
        runs = [r for r in results["rows"] if r["workers"] == count]
        steps = {key: sum(r[key]["steps"] for r in runs) for key in arms}
        seconds = {key: sum(r[key]["seconds"] for r in runs) for key in arms}
        within = sum(abs(r["asha"]["best_vs_random"]) <= 0.01 for r in runs)
        lines.append(
            f"- {count} worker{'s' if count > 1 else ''}, all seeds: ASHA {steps['asha'] / steps['random']:.2f} of "
            f"random search's steps ({steps['asha']} / {steps['random']}) and "
            f"{seconds['asha'] / seconds['random']:.2f} of its time; Optuna's pruner "
            f"{steps['pruner'] / steps['random']:.2f} of the steps, {seconds['pruner'] / seconds['random']:.2f} "
            f"of the time. ASHA's best within 1% of random search's in {within} of {len(runs)} seeds."
        )
    return "\n".join(lines)


def job_tables(results: dict[str, Any]) -> str:
    settings = results["settings"]
    rows = [
        [
            r["sharding"] + (" (captured)" if r["captured"] else ""),
            f"{r['signalled_at']} → {r['checkpointed_at']}",
            num(r["straight_chars_per_s"]),
            num(r["resumed_chars_per_s"]),
            num(r["checkpoint_save_s"]),
            num(r["checkpoint_load_s"]),
            f"{r['loss_rel_diff']:.1e}",
            f"{r['max_weight_rel_diff']:.1e} ({r['worst_weight']})",
            f"{'yes' if r['equal'] else 'NO'} (≤ {r['tolerance']:g})",
        ]
        for r in results["rows"]
    ]
    header = ["sharding", "SIGTERM after → checkpoint at step", "chars/s straight", "chars/s resumed"]
    header += ["save s", "load s", "final loss rel diff", "max weight rel diff", "same run"]
    return (
        f"`{settings['preset']}`, batch {settings['batch']} × {settings['seq_len']}, {settings['steps']} steps, "
        f"{results['precision']}, one rank.\n\n" + table(header, rows)
    )


def gpu_check_tables(results: dict[str, Any]) -> str:
    rows = [
        [p["part"], p["status"], f"{p['seconds']:.0f} ({p['limit_s']:.0f})", p["line"].replace("|", "/")]
        for p in results["parts"]
    ]
    head = f"{results['seconds']:.0f} s in all (budget {results['budget_s']:.0f} s"
    if "goal_s" in results:  # since issue 54: the limits' span, and the whole check's goal
        met = "met" if results["seconds"] <= results["goal_s"] else "NOT met"
        head += f"; the parts' limits span {results['span_s']:.0f} s; goal ≤ {results['goal_s']:.0f} s {met}"
    return head + ").\n\n" + table(["part", "status", "seconds (limit)", "result"], rows)


def gpu_learn_tables(results: dict[str, Any]) -> str:
    settings, data = results["settings"], results["data"]

    def probe(point: dict[str, Any], name: str) -> list[str]:
        p = point[name]
        return [
            f"{percent(p['test_accuracy'])} (dev {percent(p['dev_accuracy'])}, C {p['C']:g}, {p['nonzero']} units)",
            f"{percent(p['top_unit_accuracy'])} (#{p['top_unit']})",
        ]

    rows = [
        [
            f"{p['train_s'] / 60:.2f}",
            f"{p['step']:,}",
            f"{p['chars_seen'] / 1e6:,.1f}M",
            "–" if p["train_loss"] is None else f"{p['train_loss'] / math.log(2):.3f}",
            f"{p['val_bits_per_byte']:.3f}",
            *probe(p, "sst"),
            *probe(p, "imdb"),
        ]
        for p in results["points"]
    ]
    header = ["minutes trained", "step", "chars seen", "train bits/byte", "val bits/byte"]
    header += ["SST test", "SST top unit alone", "IMDB test", "IMDB top unit alone"]
    step = "captured" if results["captured"] else "eager"
    return (
        f"`{settings['preset']}` in {settings['precision']}, batch {settings['batch']} × {settings['seq_len']}, "
        f"Adam at {settings['lr']:g} ({results['warmup_steps']} warm-up steps, then linear decay), {step} step "
        f"{results['step_ms']:.1f} ms ({num(results['chars_per_s'])} chars/s); {results['epochs']:.2f} passes over "
        f"{data['train_bytes'] / 1e6:.1f} MB of reviews; probes on SST "
        f"({' / '.join(str(n) for n in data['probes']['sst'].values())} train / dev / test) and IMDB "
        f"({' / '.join(str(n) for n in data['probes']['imdb'].values())}). "
        f"{results['seconds']:.0f} s in all (budget {results['budget_s']:.0f} s).\n\n" + table(header, rows)
    )


def cli_tables(results: dict[str, Any]) -> str:
    rows = [
        [f"`mlstm-sentiment {' '.join(r['args'])}`", r["case"].partition(":")[0], num(r["seconds"]),
         ratio(r["vs_baseline"]), ", ".join(r["imports"]) or "none"]
        for r in results["cases"]
    ]  # fmt: skip
    header = ["command", "case", "seconds (median)", "× baseline", "heavy imports"]
    return (
        f"Baseline: `python -c 'import typer'`, {num(results['baseline_seconds'])} s "
        f"(median of {results['repeat']}).\n\n" + table(header, rows)
    )


def threads_tables(results: dict[str, Any]) -> str:
    rows = results["rows"]
    base = {(r["work"], r["condition"]): r["steps_per_s"] for r in rows if r["threads"] == 2}
    body = [
        [r["work"], r["condition"], str(r["threads"]), str(r["steps"]), num(r["steps_per_s"]),
         ratio(r["steps_per_s"] / base[(r["work"], r["condition"])]) if (r["work"], r["condition"]) in base else ""]
        for r in rows
    ]  # fmt: skip
    before, after = results["load_average"]
    return (
        f"{results['settings']['seconds']:g} s per row; small at {results['settings']['small_batch']} rows × 64 "
        f"bytes. The machine's load average (1 min) was {before:.1f} before the run and {after:.1f} after: "
        "other work shared its cores throughout.\n\n"
        + table(["work", "condition", "threads", "steps", "steps/s", "× 2 threads"], body)
    )
