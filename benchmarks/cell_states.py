"""Real cell states for the probe benchmark: a preset trained briefly on the shared Amazon text, then its
final cell states on SST or IMDB (the real texts and labels), both cached by their settings.

No trained model ships with the project, and the 2-core machine cannot train one for long, so the
model is trained here for a stated budget of steps (truncated BPTT with the pretraining job's own
step, ``tasks.pretrain.step.optimizer_step``, on the shared Amazon reviews, or with ``text="imdb-unsup"``
on IMDB's 50,000 unlabelled reviews: 65 MB of movie reviews, SST's domain, enough text for thousands of
steps without a second pass, where the three Amazon files hold 0.5 MB) and its features are read
with the features path every stage uses (``models.features.featurize``). ``SAMPLE`` needs no shared
data: the demo's generated reviews, whose tone follows their stars, as both the training text and the
labelled splits, so that a model trained on two cores has learned the sentiment its probe reads.
What the probe sees is then what it sees in the pipeline: unstandardised cell states of a real text model, correlated and with
heavy-tailed unit scales, not synthetic ones. Both steps take minutes to hours on two cores, so both
are cached: the model by its preset, steps, seed and training files; the features by the model and the
dataset's checksum. The budget is in steps, not seconds, so that the model is the same on any machine.
What the model learned goes into the probe's record beside its rows (``what_it_learned``): its bits per
byte on the dataset's dev texts, computed from the cached weights at each run, and its training's
seconds and last losses, written beside the weights when they were trained.

    PYTHONPATH=. .venv/bin/python benchmarks/probe.py --cases real-sst:1024 --train-steps 25
    PYTHONPATH=. .venv/bin/python benchmarks/probe.py --cases real-sst:1024 --train-steps 2000 --train-text imdb-unsup
"""

from __future__ import annotations

import csv
import functools
import gzip
import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import say

from models import config as presets
from models.features import featurize
from models.mlstm import MLSTM
from models.precision import autocast, resolve_precision
from models.text import encode
from tasks.corpus.reviews import Rejects, parse_block
from tasks.corpus.sample import write_labelled_sample, write_sample
from tasks.pretrain.step import optimizer_step
from tasks.pretrain.stream import ByteStream
from tasks.pretrain.train import bits_per_byte
from tasks.transfer.datasets import Dataset, load_dataset

REPO = Path(__file__).resolve().parents[1]
# The shared data beside the checkout (MLSTM_SHARED_DIR overrides, as in the tests).
SHARED_DATA = Path(os.environ.get("MLSTM_SHARED_DIR", REPO.parent / "shared")) / "data"
DATASETS = {"sst": "sst2", "imdb": "imdb"}
# The demo's own reviews (``tasks.corpus.sample``), generated into the cache, no shared data needed: a
# text whose tone follows its stars, so a model trained on it briefly learns sentiment. ``sample`` is
# both a training text (the demo's corpus) and a labelled dataset, about SST's size (6,920 train rows).
SAMPLE = "sample"
SAMPLE_LABELLED_REVIEWS = 11_300  # 3-star reviews are left out, then 70:15:15: 6,906 train rows
# The 2018 "small" 5-core files: real review text, 9 MB of it.
AMAZON_FILES = ("All_Beauty_5.json.gz", "AMAZON_FASHION_5.json.gz", "Appliances_5.json.gz")
BATCH, SEQ_LEN, LR = 32, 128, 2e-3
LAST_STEPS = 100  # the training loss recorded is the mean of this many last steps
HELD_OUT_BYTES = 1 << 18  # of the dataset's dev texts, to score the model on: 256 KB, seconds to read
Splits = list[tuple[np.ndarray, np.ndarray]]
# The autocasts a model may train under on the CPU, by models.precision's names (--train-precision).
PRECISIONS = ("fp32", "bf16")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Training:
    """How a real case's model is trained (``train``): the settings its weights depend on beside this
    module's constants, which name its cache file (``cached_model``) and go into the probe's record."""

    preset: str  # a models.config preset
    steps: int
    text: str = "amazon"  # one of TRAINING_TEXTS
    precision: str = "fp32"  # one of PRECISIONS: the autocast it trains under
    seed: int = 0

    def __post_init__(self) -> None:
        if self.text not in TRAINING_TEXTS:
            raise SystemExit(
                f"real cell states: no training text {self.text!r}; one of {', '.join(TRAINING_TEXTS)}"
            )
        if self.precision not in PRECISIONS:
            raise SystemExit(
                f"real cell states: no training precision {self.precision!r}; one of {', '.join(PRECISIONS)}"
            )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype it trains under (``optimizer_step``'s)."""
        return resolve_precision(self.precision, CPU)


def real_cell_states(dataset: str, training: Training, *, cache: Path, precision: str = "fp32") -> Splits:
    """Train, dev and test features of ``dataset`` (sst, imdb or ``SAMPLE``) from the model ``training``
    makes, read in ``precision`` (``featurize``'s: bf16 reads IMDB's 50,000 reviews about 3× faster on a
    CPU with bf16 in hardware; the same model either way)."""
    if dataset not in REAL_DATASETS:
        raise SystemExit(f"real cell states: no dataset {dataset!r}; one of {', '.join(REAL_DATASETS)}")
    cache.mkdir(parents=True, exist_ok=True)
    sources, read = training_text(training.text, cache)
    if missing := [str(p) for p in sources if not p.is_file()]:  # before the dataset is read
        raise SystemExit(f"real cell states: the shared training text is missing: {', '.join(missing)}")
    data = labelled(dataset, cache)
    model_path = cached_model(cache, training, sources)
    in_dtype = "" if precision == "fp32" else f"-{precision}"  # fp32's name is the one it always had
    features_path = cache / f"{dataset}-{model_path.stem}-{data.checksum[:16]}{in_dtype}.npz"
    if features_path.exists():
        say(f"  real cell states: {features_path} (cached)")
        with np.load(features_path) as saved:
            return [(saved[f"{s}_X"], saved[f"{s}_y"]) for s in ("train", "dev", "test")]
    model = MLSTM(getattr(presets, training.preset)())
    if model_path.exists():
        say(f"  {training.preset}: {model_path} (cached)")
        model.load_state_dict(torch.load(model_path, weights_only=True))
    else:
        trained = train(model, read(sources), training)
        torch.save(model.state_dict(), model_path)
        model_path.with_suffix(".json").write_text(json.dumps(trained))
    arrays: dict[str, np.ndarray] = {}
    for name, split in data.splits().items():
        arrays[f"{name}_X"] = features(model, split.texts, f"{dataset} {name}", precision)
        arrays[f"{name}_y"] = split.labels
    np.savez(features_path, **arrays)
    return [(arrays[f"{s}_X"], arrays[f"{s}_y"]) for s in ("train", "dev", "test")]


@functools.cache  # the demo's files are written once a process, not once a caller
def training_text(text: str, cache: Path) -> tuple[list[Path], Callable[[list[Path]], np.ndarray]]:
    """``text``'s files under the shared data (``TEXTS``), or the demo's corpus written into ``cache``
    (``SAMPLE``), and the reader of their review texts."""
    if text == SAMPLE:  # the same files every time (seeded): the model's cache name stays the same
        return write_sample(cache / "sample-corpus"), amazon_bytes
    files, read = TEXTS[text]
    return [SHARED_DATA / name for name in files], read


@functools.cache
def labelled(dataset: str, cache: Path) -> Dataset:
    """``dataset``'s texts and labels: SST or IMDB from the shared data, or the demo's labelled reviews
    (``SAMPLE``) written into ``cache``."""
    if dataset == SAMPLE:
        return load_dataset(
            f"{SAMPLE}={write_labelled_sample(cache / 'sample-labelled', num_reviews=SAMPLE_LABELLED_REVIEWS)}"
        )
    return load_dataset(f"{DATASETS[dataset]}={SHARED_DATA / DATASETS[dataset]}")


def cached_model(cache: Path, training: Training, sources: list[Path]) -> Path:
    """Where the model ``training`` makes of ``sources`` (``training_text``'s) is cached: named by a
    hash of everything its weights depend on."""
    # fp32 is left out of the hash, so that a model trained before bf16 was offered keeps its name.
    settings: dict[str, Any] = {} if training.precision == "fp32" else {"precision": training.precision}
    settings |= {
        "preset": training.preset,
        "train_steps": training.steps,
        "seed": training.seed,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "lr": LR,
        "files": [[p.name, p.stat().st_size] for p in sources],
    }
    return (
        cache
        / f"{training.preset}-{hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]}.pt"
    )


def what_it_learned(dataset: str, training: Training, *, cache: Path) -> dict[str, Any]:
    """What the model behind ``real_cell_states`` learned, for the record beside its probe row: its bits
    per byte on ``dataset``'s dev texts (which it never trained on), computed here from the cached
    weights, and its training as ``train`` wrote it when the model was trained (steps, seconds, the mean
    loss of its last steps; None for a model cached before that was written)."""
    model_path = cached_model(cache, training, training_text(training.text, cache)[0])
    model = MLSTM(getattr(presets, training.preset)())
    model.load_state_dict(torch.load(model_path, weights_only=True))
    model.eval()
    texts = labelled(dataset, cache).dev.texts
    held_out = np.frombuffer(b"\n".join(encode(t) for t in texts), dtype=np.uint8)[:HELD_OUT_BYTES]
    started = time.perf_counter()
    # Scored under the autocast it trained in; without a graph, which the carried state would grow across
    # the whole text.
    with torch.inference_mode(), autocast(CPU, training.dtype):
        bits = bits_per_byte(model, ByteStream.of(held_out), BATCH, SEQ_LEN)
    say(
        f"  {training.preset}: {bits:.3f} bits a byte on {len(held_out):,} bytes of {dataset}'s dev texts, "
        f"{time.perf_counter() - started:.0f} s"
    )
    sidecar = model_path.with_suffix(".json")
    return {
        "preset": training.preset,
        "text": training.text,
        "steps": training.steps,
        "precision": training.precision,
        "held_out": f"{dataset} dev",
        "held_out_bytes": len(held_out),
        "held_out_bits_per_byte": round(bits, 4),
        "training": json.loads(sidecar.read_text()) if sidecar.exists() else None,
    }


def amazon_bytes(sources: list[Path]) -> np.ndarray:
    """The review texts of ``sources``, cleaned and encoded as the corpus stage does, one per line."""
    texts: list[bytes] = []
    for path in sources:
        with gzip.open(path, "rb") as stream:
            table, _ = parse_block(stream.read(), 1, Rejects.empty())
        texts += [encode(t) for t in table.column("reviewText").to_pylist() if t]
    return np.frombuffer(b"\n".join(texts), dtype=np.uint8)


def unsup_bytes(sources: list[Path]) -> np.ndarray:
    """IMDB's unlabelled reviews (``id,text``), cleaned and encoded as the corpus stage does, one per line."""
    texts: list[bytes] = []
    for path in sources:
        with gzip.open(path, "rt", encoding="utf-8", newline="") as stream:
            texts += [encode(row["text"]) for row in csv.DictReader(stream)]
    return np.frombuffer(b"\n".join(texts), dtype=np.uint8)


# What a model can train on: its files under the shared data, and the reader of their review texts.
TEXTS: dict[str, tuple[tuple[str, ...], Callable[[list[Path]], np.ndarray]]] = {
    "amazon": (tuple(f"amazon/{name}" for name in AMAZON_FILES), amazon_bytes),
    "imdb-unsup": (("imdb/unsup.csv.gz",), unsup_bytes),
}
TRAINING_TEXTS = (*TEXTS, SAMPLE)
REAL_DATASETS = (*DATASETS, SAMPLE)


def train(model: MLSTM, data: np.ndarray, training: Training) -> dict[str, float]:
    """``training.steps`` of truncated BPTT: BATCH streams through ``data``, their state carried on,
    under ``training.precision``'s autocast (bf16: mixed precision as pretraining runs it, about 3× fp32's
    rate at 4,096 units on a CPU with bf16 in hardware). Returns its seconds and the mean loss of its
    last ``LAST_STEPS`` steps in bits a byte (one step's loss is noisy)."""
    steps, precision = training.steps, training.precision
    torch.manual_seed(training.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    stride = len(data) // BATCH
    starts = np.arange(BATCH) * stride
    state = model.zero_state(BATCH)
    model.train()
    say(
        f"  training {model.config.hidden_size} units on {len(data):,} bytes of reviews, {steps} steps "
        f"({precision})"
    )
    started = last = time.perf_counter()
    losses: deque[float] = deque(maxlen=LAST_STEPS)
    for step in range(1, steps + 1):
        offset = (step * SEQ_LEN) % (stride - SEQ_LEN - 1)
        rows = np.stack([data[s + offset : s + offset + SEQ_LEN + 1] for s in starts])
        batch = torch.from_numpy(rows.astype(np.int64))
        loss, state, _ = optimizer_step(
            model,
            optimizer,
            scaler,
            batch[:, :-1],
            batch[:, 1:],
            state,
            dtype=training.dtype,
            clip=1.0,
        )
        losses.append(float(loss) / np.log(2))
        if time.perf_counter() - last > 15:
            last = time.perf_counter()
            rate = step * BATCH * SEQ_LEN / (last - started)
            say(f"    step {step}: loss {float(loss) / np.log(2):.3f} bits/byte, {rate:,.0f} bytes/s")
    model.eval()
    seconds, last_loss = time.perf_counter() - started, float(np.mean(losses))
    say(
        f"  trained {steps} steps ({steps * BATCH * SEQ_LEN:,} bytes) in {seconds:.0f} s, "
        f"{last_loss:.3f} bits/byte over its last {len(losses)} steps"
    )
    return {
        "seconds": round(seconds, 1),
        "last_steps": len(losses),
        "last_loss_bits_per_byte": round(last_loss, 4),
    }


def features(model: MLSTM, texts: list[str], name: str, precision: str = "fp32") -> np.ndarray:
    """The final cell states of ``texts``, a progress line every 15 s."""
    done, started, last = 0, time.perf_counter(), time.perf_counter()

    def progress(rows: int, chars: int) -> None:
        nonlocal done, last
        done += rows
        if time.perf_counter() - last > 15:
            last = time.perf_counter()
            say(f"    {name}: {done:,} of {len(texts):,} texts, {last - started:.0f} s")

    features_NH = featurize(model, texts, batch_size=128, on_batch=progress, precision=precision)
    say(f"  {name}: {len(texts):,} texts in {time.perf_counter() - started:.0f} s ({precision})")
    return features_NH
