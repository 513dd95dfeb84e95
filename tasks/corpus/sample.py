"""A small review corpus the project generates itself, in the real Amazon release formats.

The demo and the tests need reviews without downloading anything. These files have the exact shape
of the published ones (2014 ``reviews_<Category>_5.json.gz``, 2018 ``<Category>_5.json.gz`` with
``style``/``vote``, 2023 ``<Category>.jsonl.gz``), with the irregularities real files have: records
repeated with another ``style``, a review without text, votes written "1,024". The text's tone
follows its star rating, so a sentiment probe has something real to find.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

CATEGORIES = {
    "Musical_Instruments": ["guitar strap", "capo", "tuner", "pop filter", "cable", "drum stick"],
    "Gift_Cards": ["gift card", "greeting card", "e-gift", "holiday card"],
    "Subscription_Boxes": ["snack box", "coffee box", "cat toy box", "book box", "razor kit"],
}
OPENINGS = {
    1: ["Terrible.", "What a waste of money.", "Do not buy this.", "Very disappointed."],
    2: ["Not great.", "Pretty disappointing.", "I expected more.", "Meh, it broke quickly."],
    3: ["It's okay.", "Average at best.", "Does the job, nothing more.", "Mixed feelings."],
    4: ["Pretty good.", "Works well.", "Happy with it overall.", "Nice quality for the price."],
    5: ["Excellent!", "Absolutely love it!", "Best purchase this year.", "Perfect, just perfect."],
}
DETAILS = {
    1: [
        "The {item} fell apart after one day.",
        "The {item} arrived broken and support ignored me.",
        "Cheap materials, the {item} is useless.",
        "I returned the {item} immediately.",
    ],
    2: [
        "The {item} works, barely.",
        "The {item} feels flimsy.",
        "Shipping was slow and the {item} is dull.",
        "The {item} stopped working after a week.",
    ],
    3: [
        "The {item} is fine for casual use.",
        "The {item} looks nicer in the photos.",
        "Some parts of the {item} are good, others not.",
        "The {item} is exactly average.",
    ],
    4: [
        "The {item} is solid and well made.",
        "My kids enjoy the {item} a lot.",
        "The {item} arrived quickly and works as described.",
        "Good value, the {item} does its job.",
    ],
    5: [
        "The {item} is wonderful &amp; beautifully made.",
        "I would buy this {item} again in a heartbeat.",
        "The {item} exceeded every expectation.",
        "Everyone loved the {item}, highly recommend!",
    ],
}
SUMMARIES = {1: "One Star", 2: "Two Stars", 3: "Three Stars", 4: "Four Stars", 5: "Five Stars"}


def _review(rng: random.Random, category: str) -> tuple[float, str, str]:
    stars = rng.choices([1, 2, 3, 4, 5], weights=[1, 1, 1, 2, 3])[0]
    item = rng.choice(CATEGORIES[category])
    sentences = [rng.choice(OPENINGS[stars])]
    sentences += [rng.choice(DETAILS[stars]).format(item=item) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.2:
        sentences.append(f"Review #{rng.randint(1, 10**9)}.\n\nThanks for reading.")
    return float(stars), " ".join(sentences), SUMMARIES[stars]


def _ids(rng: random.Random, prefix: str, length: int) -> str:
    return prefix + "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", k=length))


def write_sample(out: Path, *, num_reviews: int = 3000, seed: int = 0) -> list[Path]:
    """Write one file per release format into ``out``; returns their paths. Deterministic."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    per_file = max(1, num_reviews // 3)
    paths = []

    lines = []
    for _ in range(per_file):
        stars, text, summary = _review(rng, "Musical_Instruments")
        t = rng.randint(1_100_000_000, 1_400_000_000)
        helpful = rng.randint(0, 20)
        lines.append(
            {
                "reviewerID": _ids(rng, "A", 13),
                "asin": _ids(rng, "B00", 7),
                "reviewerName": "Customer",
                "helpful": [helpful, helpful + rng.randint(0, 5)],
                "reviewText": text,
                "overall": stars,
                "summary": summary,
                "unixReviewTime": t,
                "reviewTime": "01 1, 2012",
            }
        )
    lines[5]["reviewText"] = ""  # real 2014 files have a few empty reviews
    paths.append(_write(out / "reviews_Musical_Instruments_5.json.gz", lines))

    lines = []
    for _ in range(per_file):
        stars, text, summary = _review(rng, "Gift_Cards")
        record = {
            "overall": stars,
            "verified": rng.random() < 0.8,
            "reviewTime": "09 4, 2015",
            "reviewerID": _ids(rng, "A", 13),
            "asin": _ids(rng, "B00", 7),
            "style": {"Gift Amount:": f" {rng.choice([25, 50, 100])}"},
            "reviewerName": "Shopper",
            "reviewText": text,
            "summary": summary,
            "unixReviewTime": rng.randint(1_400_000_000, 1_540_000_000),
        }
        if rng.random() < 0.3:
            record["vote"] = f"{rng.randint(2, 3000):,}"
        lines.append(record)
        if rng.random() < 0.05:  # the same review listed again under another style
            lines.append({**record, "style": {"Gift Amount:": " 10"}})
    del lines[7]["reviewText"]
    paths.append(_write(out / "Gift_Cards_5.json.gz", lines))

    lines = []
    for _ in range(per_file):
        stars, text, summary = _review(rng, "Subscription_Boxes")
        lines.append(
            {
                "rating": stars,
                "title": summary,
                "text": text.replace("\n\n", "<br /><br />"),
                "images": [],
                "asin": _ids(rng, "B0", 8),
                "parent_asin": _ids(rng, "B0", 8),
                "user_id": _ids(rng, "AE", 26),
                "timestamp": rng.randint(1_500_000_000_000, 1_690_000_000_000),
                "helpful_vote": rng.randint(0, 30),
                "verified_purchase": rng.random() < 0.9,
            }
        )
    paths.append(_write(out / "Subscription_Boxes.jsonl.gz", lines))
    return paths


def _write(path: Path, records: list[dict[str, object]]) -> Path:
    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    # mtime=0: the same sample is the same bytes, so the corpus id is stable.
    with (
        open(path, "wb") as raw,
        gzip.GzipFile(filename=path.name[:-3], mode="wb", fileobj=raw, mtime=0) as gz,
    ):
        gz.write(body)
    return path


def write_labelled_sample(out: Path, *, num_reviews: int = 1500, seed: int = 1) -> Path:
    """Write ``train.csv``, ``dev.csv`` and ``test.csv`` (``text,label``; 4–5 stars positive, 1–2
    negative, 3 left out) of generated reviews: a labelled dataset for the demo's probe. Deterministic."""
    import csv

    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(num_reviews):
        stars, text, _summary = _review(rng, rng.choice(sorted(CATEGORIES)))
        if stars != 3:
            rows.append((text, int(stars >= 4)))
    # 70:15:15 in generation order; a repeated text may fall in two splits, as in real review data.
    cut_dev, cut_test = int(len(rows) * 0.70), int(len(rows) * 0.85)
    for name, part in (("train", rows[:cut_dev]), ("dev", rows[cut_dev:cut_test]), ("test", rows[cut_test:])):
        with (out / f"{name}.csv").open("w", newline="", encoding="utf-8") as file:
            writer = csv.writer(file)
            writer.writerow(["text", "label"])
            writer.writerows(part)
    return out
