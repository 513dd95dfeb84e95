"""Property-based bad input (hypothesis): the review parser and the served model take anything a file or a
request can hold, and answer with rows, rejected lines or one refusal, never a crash or a bad shard."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.corpus.reviews import Rejects, parse_block

# A line of a review file: a real-looking record (any text, stars of any type), a broken copy of one,
# or any bytes at all (no newline: that would make two lines).
_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
_RECORD = st.fixed_dictionaries(
    {"reviewText": st.one_of(_TEXT, st.integers(), st.none(), st.lists(st.integers(), max_size=2))},
    optional={
        "overall": st.one_of(st.floats(allow_nan=True), st.text(max_size=5), st.booleans()),
        "asin": _TEXT,
        "vote": st.one_of(_TEXT, st.integers()),
        "unixReviewTime": st.one_of(st.integers(min_value=-(2**70), max_value=2**70), _TEXT),
    },
)
_LINE = st.one_of(
    _RECORD.map(lambda r: json.dumps(r).encode()),
    _RECORD.map(lambda r: json.dumps(r).encode()[:-3]),  # cut short
    _TEXT.map(
        lambda t: b'{"reviewText": "' + t.encode().replace(b"\n", b" ") + b'\\udc80"}'
    ),  # a lone surrogate
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b" ")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_LINE, min_size=1, max_size=12))
def test_every_line_is_a_row_or_a_rejected_line_and_the_rows_are_valid_utf8(lines: list[bytes]) -> None:
    rejects = Rejects.empty()
    table, numbers = parse_block(b"\n".join(lines) + b"\n", 1, rejects)
    table.validate(full=True)  # what a shard would hold: valid UTF-8 in every string
    kept = set(numbers.tolist())
    assert kept.isdisjoint(rejects.lines)
    records = {i + 1 for i, line in enumerate(lines) if line.strip()}
    assert kept | set(rejects.lines) == records  # every non-blank line accounted for, once
    assert all(reason for reason in rejects.reasons)


@pytest.fixture(scope="module")
def served() -> Any:
    from models.classifier import SentimentClassifier
    from models.mlstm import MLSTM, tiny
    from models.serving import SentimentModel

    model = MLSTM(tiny())
    coef = np.random.default_rng(0).normal(size=model.config.hidden_size).astype(np.float32)
    return SentimentModel(SentimentClassifier(model, coef, 0.0, {"max_text_chars": 200}))


_CELL = st.one_of(
    _TEXT, st.integers(), st.floats(), st.none(), st.booleans(), st.text(min_size=201, max_size=210)
)
_PARAMS = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"batch_size": st.one_of(st.integers(), st.floats(), st.text(max_size=4), st.none())},
        optional={"precision": st.one_of(st.sampled_from(["auto", "fp32", "bf16"]), st.text(max_size=4))},
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_CELL, min_size=1, max_size=5), _PARAMS)
def test_the_served_model_scores_or_refuses_in_one_message(
    served: Any, cells: list[Any], params: Any
) -> None:
    from models.serving import TextRejected

    try:
        answer = served.predict(pd.DataFrame({"text": pd.Series(cells, dtype=object)}), params=params)
    except TextRejected as refused:  # the scoring server's 400: one message naming the row or parameter
        assert "\n" not in refused.message and refused.message.startswith(("row ", "params: ")), (
            refused.message
        )
        return
    assert len(answer) == len(cells) and set(answer["label"]) <= {"positive", "negative"}
    assert answer["probability"].between(0, 1).all()
    assert all(isinstance(c, str) and c.strip() and len(c) <= 200 for c in cells)


def test_the_fuzzed_parser_can_see_an_invalid_row() -> None:
    """The property above would pass vacuously if validation never failed: raw bytes do fail it."""
    with pytest.raises(pa.ArrowInvalid):
        pa.array([b"bad \xff"], pa.binary()).cast(pa.string()).validate(full=True)
