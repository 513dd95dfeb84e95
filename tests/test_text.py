"""The cleaning is part of the model's input: the corpus's vectorised version must match it exactly."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pytest

from models.text import WHITESPACE, clean_text, encode
from tasks.corpus.reviews import clean_text_column


def test_clean_text_follows_radford() -> None:
    assert clean_text("Great &amp; cheap!\nWould buy again.  ") == "\n Great & cheap! Would buy again. "
    assert clean_text("  \t") == "\n  "
    assert encode("café") == "\n café ".encode()


def test_whitespace_set_is_exactly_what_str_strip_removes() -> None:
    assert "".join(chr(c) for c in range(0x110000) if chr(c).isspace()) == WHITESPACE


ADVERSARIAL = [
    "plain",
    "",
    "   ",
    "\n\nlines\r\nand\rreturns\n",
    "&amp;&lt;b&gt; &#10;entity newline&#10;",
    "&ampno semicolon &copy &notin; &#x27;",
    "\u3000ideographic space\u3000",
    "\x1c\x1dfile separators\x1e\x1f",
    "\xa0nbsp\u2028line sep\u2029",
    "emoji 😀 and accents éàü",
    "<br /><br />markup stays",
    None,
]


def test_vectorised_cleaning_matches_on_adversarial_strings() -> None:
    cleaned = clean_text_column(pa.array(ADVERSARIAL, pa.large_string())).to_pylist()
    assert cleaned == [None if t is None else clean_text(t) for t in ADVERSARIAL]


def _review_texts(path: Path) -> list[str]:
    texts = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            text = record.get("reviewText", record.get("text"))
            if isinstance(text, str):
                texts.append(text)
    return texts


@pytest.mark.slow
def test_vectorised_cleaning_matches_on_every_real_review(amazon_complete: list[Path]) -> None:
    for path in amazon_complete:
        texts = _review_texts(path)
        cleaned = clean_text_column(pa.array(texts, pa.large_string())).to_pylist()
        mismatches = [t for t, c in zip(texts, cleaned, strict=True) if clean_text(t) != c]
        assert not mismatches, (
            f"{path.name}: {len(mismatches)} texts clean differently, e.g. {mismatches[0]!r}"
        )
