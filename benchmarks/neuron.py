#!/usr/bin/env python
"""The sentiment neuron held: the classifier's mean P(positive) of reviews written with the top unit held
positive vs held negative (Radford et al. 2017, Table 2), on a registered classifier.

For each of ``positive`` and ``negative``, ``--samples`` reviews of ``--length`` bytes are written by
``tasks.transfer.explain.write_reviews`` (what ``mlstm-sentiment generate --sentiment …`` runs: the unit's
cell value overwritten after every step) with the same seed, and scored by the same classifier. The first
row holds the unit where ``generate --sentiment positive|negative`` does (each class's mean of the unit on
the probe's training features, pushed 2× from their midpoint); ``--holds 1,8`` adds a row per value, the
unit held at ±value in the direction of the probe's weight. A model makes no promise about the gap: it is a
measurement, not a test.

    MLSTM_HOME=/tmp/neuron-demo PYTHONPATH=. .venv/bin/python benchmarks/neuron.py [--model URI] \
        [--holds 1,8] [--json] [--record]
"""

from __future__ import annotations

import json
import math
from typing import Any

from common import add_record_option, machine, new_parser, record, say

from flows.cli.neuron import load_classifier, top_unit
from tasks.transfer.explain import write_reviews


def side(p_N: Any, value: float | None) -> dict[str, Any]:
    mean = float(p_N.mean())
    stderr = float(p_N.std(ddof=1) / math.sqrt(len(p_N))) if len(p_N) > 1 else None
    return {
        "value": value,
        "mean_probability": mean,
        "stderr": stderr,
        "min_probability": float(p_N.min()),
        "max_probability": float(p_N.max()),
    }


def measure(
    model: str | None,
    *,
    samples: int,
    length: int,
    temperature: float,
    seed: int,
    prompt: str,
    holds: list[float],
) -> dict[str, Any]:
    """One row per way of holding the unit: mean (and its standard error), min and max P(positive) of the
    positive-held and negative-held samples, and their difference."""
    classifier, uri = load_classifier(model)
    unit = top_unit(classifier)
    sign = 1.0 if classifier.coef_H[unit] >= 0 else -1.0
    means = classifier.class_means_2H
    result: dict[str, Any] = {"model": uri, "unit": unit, "samples": samples, "length": length}
    result |= {"temperature": temperature, "seed": seed, "prompt": prompt}
    result["class_means"] = (
        None if means is None else {"negative": float(means[0, unit]), "positive": float(means[1, unit])}
    )
    rows = []
    for hold in [None, *holds]:
        row: dict[str, Any] = {"held": "generate" if hold is None else f"±{hold:g}"}
        for sentiment in ("positive", "negative"):
            say(f"{row['held']}: {samples} samples held {sentiment}")
            written = write_reviews(
                classifier,
                prompt,
                sentiment=sentiment
                if hold is None
                else str(hold * sign * (1 if sentiment == "positive" else -1)),
                unit=unit,
                length=length,
                temperature=temperature,
                samples=samples,
                seed=seed,
            )
            assert written.probability is not None  # a registered classifier has its probe
            row[sentiment] = side(written.probability, written.value)
            if hold is None:
                row["basis"] = written.basis
        row["gap"] = row["positive"]["mean_probability"] - row["negative"]["mean_probability"]
        rows.append(row)
    result["rows"] = rows
    return result


def main() -> None:
    parser = new_parser(__doc__ or "", raw=True)
    parser.add_argument("--model", help="MLflow model URI [default: models:/<MLSTM_MODEL_NAME>@champion]")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default="")
    parser.add_argument(
        "--holds",
        type=lambda text: [float(v) for v in text.split(",") if v],
        default=[],
        help="comma-separated values: a row each, the unit held at ±value in the probe's direction",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_record_option(parser)
    args = parser.parse_args()
    result = measure(
        args.model,
        samples=args.samples,
        length=args.length,
        temperature=args.temperature,
        seed=args.seed,
        prompt=args.prompt,
        holds=args.holds,
    )
    record("neuron", args.record, {"machine": machine(), **result})
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}, unit {result['unit']}, {args.samples} samples of {args.length} bytes each")
    for row in result["rows"]:
        for sentiment in ("positive", "negative"):
            s = row[sentiment]
            print(
                f"{row['held']} held {sentiment} (value {s['value']:+.3g}): mean P(positive) "
                f"{s['mean_probability']:.3f} ± {s['stderr'] or 0:.3f} "
                f"(min {s['min_probability']:.3f}, max {s['max_probability']:.3f})"
            )
        print(f"{row['held']}: gap {row['gap']:+.3f}")


if __name__ == "__main__":
    main()
