"""Published mLSTM weights as our checkpoints: OpenAI's release of Radford et al. (2017).

OpenAI's model (openai/generating-reviews-discovering-sentiment, folder ``model/``) is 15 ``.npy``
files, E the byte embedding (64), H the hidden units (4096):

    0  embedding [256, E]          6  wmx [E, H]        9-12  gains gx [4H], gh [4H], gmx [H], gmh [H]
    1  wx [E, 4H]                  7  wmh [H, H]        13    read-out weight [H, 256]
    2-5  wh in four column blocks  8  b [4H]            14    read-out bias [256]
         [H, H], joined on axis 1

Their matrices are [in, out] as ours are, their weight normalisation ``l2_normalize(v, axis=0) · g``
is ours, their gate order i, f, o, u is ours and their cleaning is ``models.text``'s, so importing is
a renaming plus one transpose (our read-out is an ``nn.Linear``, which keeps [out, in]). E and H come
from the files, so smaller models in the same layout import too. Files are loaded with
``allow_pickle=False``: a ``.npy`` holding Python objects is refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.mlstm import MLSTMConfig
from models.text import CLEANING
from tasks.jobs.checkpoint import read_latest, save_checkpoint
from tasks.store import open_store

OPENAI_SOURCE = "openai/generating-reviews-discovering-sentiment"
OPENAI_PAPER = (
    "Radford, Jozefowicz and Sutskever (2017), Learning to Generate Reviews and Discovering Sentiment"
)
VOCAB_SIZE = 256  # bytes
NUM_FILES = 15
# What each file holds, in their names: "wh0".."wh3" are the column blocks of wh.
FILE_ROLES = (
    "embedding", "wx", "wh0", "wh1", "wh2", "wh3", "wmx", "wmh", "b", "gx", "gh", "gmx", "gmh", "out_w", "out_b",
)  # fmt: skip
FLOAT_DTYPES = (np.float16, np.float32, np.float64)

# Our parameter ← their array (after wh is joined).
OURS_FROM_THEIRS = {
    "embed.weight": "embedding",
    "w_x": "wx",
    "w_h": "wh",
    "w_mx": "wmx",
    "w_mh": "wmh",
    "g_x": "gx",
    "g_h": "gh",
    "g_mx": "gmx",
    "g_mh": "gmh",
    "b": "b",
    "out.weight": "out_w",  # transposed: nn.Linear keeps [out, in]
    "out.bias": "out_b",
}


class WeightsError(ValueError):
    """Weight files that cannot be imported, naming the file and what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class OpenAIRelease:
    """OpenAI's arrays by their names (float32, ``wh`` joined) and the sha256 of each file."""

    arrays: dict[str, np.ndarray]
    sha256: dict[str, str]


def _file_name(index: int) -> str:
    return f"{index}.npy"


def _load_file(folder: Path, index: int) -> tuple[np.ndarray, str]:
    """One plain float array as float32, and the sha256 of the very bytes it was read from."""
    data = (folder / _file_name(index)).read_bytes()
    label = f"{_file_name(index)} ({FILE_ROLES[index]})"
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        # numpy says "allow_pickle=False" for object arrays and pickles alike: say what that means here.
        raise WeightsError(
            f"{label} is not a plain numeric .npy array ({error}); it was not unpickled"
        ) from None
    if not isinstance(array, np.ndarray):  # an .npz archive under a .npy name
        raise WeightsError(f"{label} is not a single .npy array")
    if array.dtype.type not in FLOAT_DTYPES:
        raise WeightsError(f"{label} has dtype {array.dtype}, expected float16, float32 or float64")
    with np.errstate(over="ignore"):  # float64 values beyond float32's range become inf: reported below
        array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        num_bad = int(array.size - np.isfinite(array).sum())
        raise WeightsError(f"{label} has {num_bad} values that are not finite (as float32)")
    return array, hashlib.sha256(data).hexdigest()


def expected_shapes(embed_size: int, hidden_size: int) -> list[tuple[int, ...]]:
    """The shape of each of the 15 files, in file order."""
    E, H, V = embed_size, hidden_size, VOCAB_SIZE
    return [
        (V, E), (E, 4 * H), (H, H), (H, H), (H, H), (H, H), (E, H), (H, H),
        (4 * H,), (4 * H,), (4 * H,), (H,), (H,), (H, V), (V,),
    ]  # fmt: skip


def read_openai(folder: Path) -> OpenAIRelease:
    """Load and check OpenAI's 15 files: E from 0.npy, H from 7.npy (wmh, [H, H]), every shape against them."""
    folder = Path(folder)
    if not folder.is_dir():
        raise WeightsError(f"{folder} is not a folder: pass the model/ folder of {OPENAI_SOURCE}")
    missing = [_file_name(i) for i in range(NUM_FILES) if not (folder / _file_name(i)).is_file()]
    if missing:
        raise WeightsError(
            f"{folder} lacks {', '.join(missing)}: OpenAI's model/ folder holds 0.npy … {NUM_FILES - 1}.npy"
        )
    arrays, sha256 = [], {}
    for i in range(NUM_FILES):
        array, sha256[_file_name(i)] = _load_file(folder, i)
        arrays.append(array)
    embedding, wmh = arrays[0], arrays[7]
    if embedding.ndim != 2 or embedding.shape[0] != VOCAB_SIZE or embedding.shape[1] < 1:
        raise WeightsError(
            f"0.npy (embedding) has shape {embedding.shape}, expected ({VOCAB_SIZE}, E): one row per byte"
        )
    if wmh.ndim != 2 or wmh.shape[0] != wmh.shape[1] or wmh.shape[0] < 1:
        raise WeightsError(f"7.npy (wmh) has shape {wmh.shape}, expected (H, H)")
    E, H = embedding.shape[1], wmh.shape[0]
    for i, (array, shape) in enumerate(zip(arrays, expected_shapes(E, H), strict=True)):
        if array.shape != shape:
            raise WeightsError(
                f"{_file_name(i)} ({FILE_ROLES[i]}) has shape {array.shape}, expected {shape} "
                f"(E={E} from 0.npy, H={H} from 7.npy)"
            )
    by_role = dict(zip(FILE_ROLES, arrays, strict=True))
    # Their code joins the four [H, H] blocks of wh on axis 1: block k holds gate k's columns.
    wh = np.concatenate([by_role.pop(f"wh{k}") for k in range(4)], axis=1)
    return OpenAIRelease(arrays={**by_role, "wh": wh}, sha256=sha256)


def openai_state_dict(arrays: Mapping[str, np.ndarray]) -> tuple[MLSTMConfig, dict[str, torch.Tensor]]:
    """Our config and ``MLSTM`` state dict from OpenAI's arrays (as ``read_openai`` returns them)."""
    vocab_size, embed_size = arrays["embedding"].shape
    config = MLSTMConfig(hidden_size=arrays["wmh"].shape[0], embed_size=embed_size, vocab_size=vocab_size)
    state = {}
    for ours, theirs in OURS_FROM_THEIRS.items():
        array = arrays[theirs].T if ours == "out.weight" else arrays[theirs]
        state[ours] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    return config, state


def _check_run_name(run: str) -> None:
    # The same rule as the training job's run names: a run is one folder under runs/.
    if not run or "/" in run or run.strip() != run or run in (".", ".."):
        raise WeightsError(f"run name {run!r} must be a non-empty name without '/' or surrounding spaces")


def import_openai(folder: Path, store_uri: str, *, run: str | None = None, **store_options: Any) -> str:
    """Write OpenAI's weights in ``folder`` as step 0 of run ``run`` (default ``openai-<H>``); return its URI.

    ``tasks.jobs.checkpoint.load_checkpoint(uri).model()`` then gives the model. Importing again writes the
    same checkpoint to the same URI. A run that holds checkpoints from elsewhere (a pretraining run of
    the same name) is refused rather than having its ``latest.json`` pointed at the import.
    ``store_options`` go to ``open_store`` (``endpoint_url``, ``max_attempts``).
    """
    if run is not None:
        _check_run_name(run)  # before reading hundreds of MB
    release = read_openai(folder)
    config, state = openai_state_dict(release.arrays)
    run = run if run is not None else f"openai-{config.hidden_size}"
    store = open_store(store_uri, **store_options)
    latest = read_latest(store, run)
    if latest is not None and latest.get("source") != OPENAI_SOURCE:
        raise WeightsError(
            f"run {run!r} in {store.uri} already holds checkpoints that are not an import of "
            f"{OPENAI_SOURCE}: pass another --run"
        )
    meta = {
        "model": dataclasses.asdict(config),
        "source": OPENAI_SOURCE,
        "paper": OPENAI_PAPER,
        "files": release.sha256,  # sha256 of each file as read
        "cleaning": CLEANING,
        "feature": "final cell state",
    }
    return save_checkpoint(store, run, step=0, state={"model": state}, meta=meta)


# Importers by the name the command line takes.
IMPORTERS: dict[str, Callable[..., str]] = {"openai": import_openai}


def import_weights(
    source: str, folder: Path, store_uri: str, *, run: str | None = None, **store_options: Any
) -> str:
    """Import published weights of a known ``source`` into the store; returns the checkpoint's URI."""
    if source not in IMPORTERS:
        raise WeightsError(f"unknown weights source {source!r}: choose one of {', '.join(IMPORTERS)}")
    return IMPORTERS[source](Path(folder), store_uri, run=run, **store_options)
