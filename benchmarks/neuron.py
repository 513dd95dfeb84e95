#!/usr/bin/env python
"""The sentiment neuron held: the classifier's mean P(positive) of reviews written with the top unit held
positive vs held negative (Radford et al. 2017, Table 2), on a registered classifier.

For each of ``positive`` and ``negative``, ``--samples`` reviews of ``--length`` bytes are written by
``tasks.transfer.explain.write_reviews`` (what ``mlstm-sentiment generate --sentiment …`` runs: the unit's
cell value overwritten after every step, at ±1 in the direction of the probe's weight) with the same
seed, and scored by the same classifier. A model makes no promise about the gap: it is a measurement.

    MLSTM_HOME=/tmp/neuron-demo PYTHONPATH=. .venv/bin/python benchmarks/neuron.py [--model URI] [--json]
"""

from __future__ import annotations

import argparse
import json

from flows.cli.neuron import load_classifier, top_unit
from tasks.transfer.explain import write_reviews


def measure(
    model: str | None,
    *,
    samples: int,
    length: int,
    temperature: float,
    seed: int,
    prompt: str,
    hold: float | None = None,
) -> dict[str, object]:
    """Mean, min and max P(positive) of the positive-held and negative-held samples; ``hold`` replaces
    the ±1 of ``--sentiment positive|negative`` by ±hold (in the direction of the probe's weight)."""
    classifier, uri = load_classifier(model)
    unit = top_unit(classifier)
    sign = 1.0 if classifier.coef_H[unit] >= 0 else -1.0
    result: dict[str, object] = {"model": uri, "unit": unit, "samples": samples, "length": length}
    result |= {"temperature": temperature, "seed": seed, "prompt": prompt}
    for sentiment in ("positive", "negative"):
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
        p_N = written.probability
        result[sentiment] = {
            "value": written.value,
            "mean_probability": float(p_N.mean()),
            "min_probability": float(p_N.min()),
            "max_probability": float(p_N.max()),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="MLflow model URI [default: models:/<MLSTM_MODEL_NAME>@champion]")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", default="")
    parser.add_argument("--hold", type=float, help="hold at ±HOLD instead of generate's ±1")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = measure(
        args.model,
        samples=args.samples,
        length=args.length,
        temperature=args.temperature,
        seed=args.seed,
        prompt=args.prompt,
        hold=args.hold,
    )
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']}, unit {result['unit']}, {args.samples} samples of {args.length} bytes each")
    for sentiment in ("positive", "negative"):
        row = result[sentiment]
        assert isinstance(row, dict)
        print(
            f"held {sentiment} (value {row['value']:+g}): mean P(positive) {row['mean_probability']:.3f} "
            f"(min {row['min_probability']:.3f}, max {row['max_probability']:.3f})"
        )


if __name__ == "__main__":
    main()
