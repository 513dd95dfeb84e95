"""Importing OpenAI's released mLSTM weights: parity with an independent numpy reading of their layout.

The reference below is written from the release's description (Radford et al. 2017, the repo's
``encoder.py`` and ``utils.py``), not from our model: their cleaning, their weight normalisation
(``tf.nn.l2_normalize`` per column, times the gain), their cell, in float64, one text at a time.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from models.features import featurize
from models.text import CLEANING
from tasks.jobs.checkpoint import load_checkpoint, save_checkpoint
from tasks.store import open_store
from tasks.transfer.weights import (
    OPENAI_SOURCE,
    WeightsError,
    import_openai,
    import_weights,
    openai_state_dict,
    read_openai,
)

TEXTS = [
    "This product is great &amp; cheap. I&#39;d buy it again!",
    "  leading and trailing spaces\nand a newline inside  ",
    "Ünïcödé: 日本語のレビュー — très bien 👍",
    "",
    "ok",
    # About 700 bytes: longer than the model's 256-step chunks, and far longer than the rest of its batch.
    "Terrible. " * 35 + "Actually &lt;fine&gt;, " * 15,
]


def write_release(
    folder: Path, *, hidden: int, embed: int = 64, seed: int = 0, dtypes: dict[int, type] | None = None
) -> list[np.ndarray]:
    """Random weights in OpenAI's layout as 0.npy … 14.npy; returns the arrays as written."""
    rng = np.random.default_rng(seed)
    H, E, V = hidden, embed, 256

    def matrix(rows: int, cols: int) -> np.ndarray:
        # Columns of unequal norms, so that the weight normalisation matters.
        return rng.normal(size=(rows, cols)) * rng.uniform(0.2, 3.0, size=cols)

    def gain(n: int) -> np.ndarray:
        # Away from 1 and of both signs, so a gain that is ignored or misplaced shows.
        return rng.uniform(0.5, 2.0, size=n) * rng.choice([-1.0, 1.0], size=n)

    arrays = [
        rng.normal(scale=0.8, size=(V, E)),  # embedding
        matrix(E, 4 * H),  # wx
        *(matrix(H, H) for _ in range(4)),  # wh, one [H, H] block per gate
        matrix(E, H),  # wmx
        matrix(H, H),  # wmh
        rng.normal(scale=0.5, size=4 * H),  # b
        gain(4 * H),  # gx
        gain(4 * H),  # gh
        gain(H),  # gmx
        gain(H),  # gmh
        rng.normal(size=(H, V)),  # read-out weight
        rng.normal(size=V),  # read-out bias
    ]
    dtypes = dtypes or {}
    written = []
    for i, array in enumerate(arrays):
        array = array.astype(dtypes.get(i, np.float32))
        np.save(folder / f"{i}.npy", array)
        written.append(array)
    return written


# -- the independent reference -------------------------------------------------------------------------


def reference_bytes(text: str) -> bytes:
    """Their ``preprocess``: unescape HTML, newlines to spaces, strip, pad with "\\n " and " "."""
    text = html.unescape(text)
    text = text.replace("\n", " ").strip()
    return ("\n " + text + " ").encode("utf-8")


def l2_normalize_times_gain(v: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``tf.nn.l2_normalize(v, dim=0) * g``: each column scaled to norm 1, then by its gain."""
    return v / np.sqrt(np.maximum((v * v).sum(axis=0, keepdims=True), 1e-12)) * g


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def reference_read(files: list[np.ndarray], text: str) -> tuple[np.ndarray, np.ndarray]:
    """Final cell state [H] and the hidden state after every byte [T, H], in float64."""
    p = [np.asarray(f, dtype=np.float64) for f in files]
    embedding, wx, wh, wmx, wmh = p[0], p[1], np.concatenate(p[2:6], axis=1), p[6], p[7]
    b, gx, gh, gmx, gmh = p[8], p[9], p[10], p[11], p[12]
    wx, wh = l2_normalize_times_gain(wx, gx), l2_normalize_times_gain(wh, gh)
    wmx, wmh = l2_normalize_times_gain(wmx, gmx), l2_normalize_times_gain(wmh, gmh)
    H = wmh.shape[0]
    c, h = np.zeros(H), np.zeros(H)
    hs = []
    for byte in reference_bytes(text):
        x = embedding[byte]
        m = (x @ wmx) * (h @ wmh)
        z = x @ wx + m @ wh + b
        i, f, o, u = np.split(z, 4)
        c = sigmoid(f) * c + sigmoid(i) * np.tanh(u)
        h = sigmoid(o) * np.tanh(c)
        hs.append(h)
    return c, np.stack(hs)


def reference_features(files: list[np.ndarray], texts: list[str]) -> np.ndarray:
    return np.stack([reference_read(files, text)[0] for text in texts])


def assert_features_match(ours: np.ndarray, ref: np.ndarray) -> None:
    # rtol 1e-5: float32 arithmetic over ~700 recurrent steps. atol, 1e-6 of the largest feature, is for
    # the few cell states near zero; float32 misses by at most ~2.5e-7 of the scale here, while a mistake
    # in the layout (a transpose, a gate order, a gain) moves features by ~1x the scale, and even shifting
    # every bias by 1e-3 moves them by ~2e-3 of it.
    scale = float(np.abs(ref).max())
    assert scale > 0.5, "random weights this strong give cell states of order one"
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6 * scale)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[np.ndarray]]:
    folder = tmp_path_factory.mktemp("openai-model")
    return folder, write_release(folder, hidden=32)


# -- parity ---------------------------------------------------------------------------------------------


def test_features_match_an_independent_numpy_reading(
    release: tuple[Path, list[np.ndarray]], tmp_path: Path
) -> None:
    folder, files = release
    uri = import_openai(folder, str(tmp_path / "store"))
    model = load_checkpoint(uri).model()
    assert (model.config.hidden_size, model.config.embed_size, model.config.vocab_size) == (32, 64, 256)
    ref = reference_features(files, TEXTS)
    # Batches of 4 put texts of very different lengths together: padding must not reach any feature.
    assert_features_match(featurize(model, TEXTS, batch_size=4), ref)
    assert_features_match(featurize(model, TEXTS, batch_size=1), ref)


def test_next_byte_logits_match(release: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    folder, files = release
    model = load_checkpoint(import_openai(folder, str(tmp_path / "store"))).model().eval()
    text = TEXTS[0]
    ref_c, hs = reference_read(files, text)
    ref_logits = hs @ files[13].astype(np.float64) + files[14]
    data = torch.tensor(list(reference_bytes(text)), dtype=torch.int64)[None]
    with torch.no_grad():
        logits, (_, c_final), _ = model(data)
    np.testing.assert_allclose(logits[0].numpy(), ref_logits, rtol=1e-5, atol=1e-6 * np.abs(ref_logits).max())
    np.testing.assert_allclose(c_final[0].numpy(), ref_c, rtol=1e-5, atol=1e-6)


def test_sizes_and_dtypes_come_from_the_files(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    # H=8 and E=16, in float16, float32 and float64 files: all stored as float32.
    dtypes = {0: np.float16, 1: np.float64, 7: np.float64, 13: np.float16}
    files = write_release(tmp_path / "model", hidden=8, embed=16, seed=1, dtypes=dtypes)
    uri = import_openai(tmp_path / "model", str(tmp_path / "store"))
    assert uri.endswith("runs/openai-8/checkpoints/step-0000000")
    checkpoint = load_checkpoint(uri)
    assert checkpoint.meta["model"] == {"hidden_size": 8, "embed_size": 16, "vocab_size": 256}
    assert {t.dtype for t in checkpoint.state["model"].values()} == {torch.float32}
    assert_features_match(
        featurize(checkpoint.model(), TEXTS, batch_size=3), reference_features(files, TEXTS)
    )


def test_state_dict_is_their_arrays_renamed(release: tuple[Path, list[np.ndarray]]) -> None:
    folder, files = release
    config, state = openai_state_dict(read_openai(folder).arrays)
    assert config.hidden_size == 32
    np.testing.assert_array_equal(state["w_h"].numpy(), np.concatenate(files[2:6], axis=1))
    np.testing.assert_array_equal(state["out.weight"].numpy(), files[13].T)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in state.values())


# -- the checkpoint ---------------------------------------------------------------------------------------


def test_checkpoint_records_its_provenance(release: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    folder, _ = release
    uri = import_openai(folder, str(tmp_path / "store"))
    assert uri == str((tmp_path / "store").resolve() / "runs/openai-32/checkpoints/step-0000000")
    meta = load_checkpoint(uri).meta
    assert meta["source"] == OPENAI_SOURCE
    assert meta["cleaning"] == CLEANING
    assert (meta["step"], meta["run"]) == (0, "openai-32")
    assert meta["files"] == {
        f"{i}.npy": hashlib.sha256((folder / f"{i}.npy").read_bytes()).hexdigest() for i in range(15)
    }
    # The run's latest.json points at it, so the run folder loads too.
    assert load_checkpoint(str(tmp_path / "store" / "runs" / "openai-32")).uri == uri


def test_importing_again_is_idempotent(release: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    folder, _ = release
    store = str(tmp_path / "store")
    first = import_openai(folder, store)
    weights = load_checkpoint(first).state["model"]
    second = import_openai(folder, store)
    assert second == first
    again = load_checkpoint(second).state["model"]
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    assert sorted(p.name for p in (tmp_path / "store" / "runs" / "openai-32" / "checkpoints").iterdir()) == [
        "step-0000000"
    ]


def test_a_run_with_other_checkpoints_is_left_alone(
    release: tuple[Path, list[np.ndarray]], tmp_path: Path
) -> None:
    folder, _ = release
    store = open_store(str(tmp_path / "store"))
    save_checkpoint(store, "openai-32", 500, {"model": {}}, {"model": {"hidden_size": 32}})
    with pytest.raises(WeightsError, match=r"'openai-32'.*not an import.*--run"):
        import_openai(folder, store.uri)
    assert json.loads(store.read_bytes("runs/openai-32/latest.json"))["step"] == 500
    assert import_openai(folder, store.uri, run="openai-elsewhere").endswith(
        "runs/openai-elsewhere/checkpoints/step-0000000"
    )


def test_import_through_s3(release: tuple[Path, list[np.ndarray]], s3_bucket: str) -> None:
    folder, files = release
    uri = import_openai(folder, f"s3://{s3_bucket}/w")
    assert uri == f"s3://{s3_bucket}/w/runs/openai-32/checkpoints/step-0000000"
    model = load_checkpoint(uri).model()
    assert_features_match(featurize(model, TEXTS[:3], batch_size=2), reference_features(files, TEXTS[:3]))


# -- what the command line calls ---------------------------------------------------------------------------


def test_import_weights_by_source_name(release: tuple[Path, list[np.ndarray]], tmp_path: Path) -> None:
    folder, _ = release
    uri = import_weights("openai", str(folder), str(tmp_path / "store"), run="radford")
    assert uri.endswith("runs/radford/checkpoints/step-0000000")
    assert load_checkpoint(uri).model().config.hidden_size == 32
    with pytest.raises(WeightsError, match="unknown weights source 'gpt2': choose one of openai"):
        import_weights("gpt2", folder, str(tmp_path / "store"))
    for bad in ("", "a/b", " x", ".."):
        with pytest.raises(WeightsError, match="run name"):
            import_weights("openai", folder, str(tmp_path / "store"), run=bad)


# -- files that are refused ------------------------------------------------------------------------------


@pytest.fixture
def copy_of_release(release: tuple[Path, list[np.ndarray]], tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for i in range(15):
        (folder / f"{i}.npy").write_bytes((release[0] / f"{i}.npy").read_bytes())
    return folder


def test_missing_files_are_listed(copy_of_release: Path) -> None:
    (copy_of_release / "3.npy").unlink()
    (copy_of_release / "11.npy").unlink()
    with pytest.raises(WeightsError, match=r"lacks 3\.npy, 11\.npy"):
        read_openai(copy_of_release)
    with pytest.raises(WeightsError, match="is not a folder"):
        read_openai(copy_of_release / "nowhere")


@pytest.mark.parametrize(
    ("index", "shape", "message"),
    [
        (6, (64, 31), r"6\.npy \(wmx\) has shape \(64, 31\), expected \(64, 32\)"),
        (3, (32, 33), r"3\.npy \(wh1\) has shape \(32, 33\), expected \(32, 32\)"),
        (14, (255,), r"14\.npy \(out_b\) has shape \(255,\), expected \(256,\)"),
        (7, (32, 16), r"7\.npy \(wmh\) has shape \(32, 16\), expected \(H, H\)"),
        (0, (128, 64), r"0\.npy \(embedding\) has shape \(128, 64\), expected \(256, E\)"),
    ],
)
def test_a_wrong_shape_names_the_file_and_both_shapes(
    copy_of_release: Path, index: int, shape: tuple[int, ...], message: str
) -> None:
    np.save(copy_of_release / f"{index}.npy", np.ones(shape, dtype=np.float32))
    with pytest.raises(WeightsError, match=message):
        read_openai(copy_of_release)


class _MakesADirWhenUnpickled:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.path),)


def test_pickled_arrays_are_refused_unopened(copy_of_release: Path, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    payload = np.array([_MakesADirWhenUnpickled(marker)], dtype=object)
    np.save(copy_of_release / "9.npy", payload, allow_pickle=True)
    with pytest.raises(
        WeightsError, match=r"9\.npy \(gx\) is not a plain numeric \.npy array.*not unpickled"
    ):
        import_openai(copy_of_release, str(tmp_path / "store"))
    assert not marker.exists()
    assert not (tmp_path / "store").exists()
    # A pickle under a .npy name (no .npy header at all) is refused the same way.
    (copy_of_release / "9.npy").write_bytes(pickle.dumps(payload))
    with pytest.raises(WeightsError, match=r"9\.npy \(gx\) is not a plain numeric"):
        read_openai(copy_of_release)
    assert not marker.exists()
    # The payload does act when unpickled, so the checks above mean something.
    pickle.loads((copy_of_release / "9.npy").read_bytes())
    assert marker.is_dir()


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (
            np.ones(128, dtype=np.int32),
            r"10\.npy \(gh\) has dtype int32, expected float16, float32 or float64",
        ),
        (np.full(128, np.nan, dtype=np.float32), r"10\.npy \(gh\) has 128 values that are not finite"),
        (np.full(128, 1e300), r"10\.npy \(gh\) has 128 values that are not finite"),
    ],
)
def test_non_float_and_non_finite_arrays_are_refused(
    copy_of_release: Path, array: np.ndarray, message: str
) -> None:
    np.save(copy_of_release / "10.npy", array)
    with pytest.raises(WeightsError, match=message):
        read_openai(copy_of_release)
