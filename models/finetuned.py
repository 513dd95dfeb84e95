"""The fine-tuned classifier of Kant et al. (2018): the mLSTM and a head on its pooled cell states,
trained together on the labelled task, with the language model's next-byte loss kept as an auxiliary.

Legend: B batch, T time steps (bytes), H hidden units, P pooled width (H, or 3H for ``concat``).
Per text, with the mLSTM's cell state c_t after byte t (models/mlstm.py) and its length L:

    last    p = c_L                                 (the probe's feature, Radford et al. 2017)
    mean    p = (1/L) Σ_t c_t
    max     p = max_t c_t                           (per unit)
    concat  p = [c_L; mean; max]                    (Howard & Ruder 2018's concat pooling)
    linear  z = p w + b         mlp  z = relu(p W_1 + b_1) w_2 + b_2
    P(positive | text) = σ(z)
    loss = BCE(z, y) + λ · (1/B) Σ_b mean_t CE(next byte)     λ: the auxiliary LM weight

Texts are padded at their end; the recurrence reads left to right, so padding never reaches a state
the pooling reads, and masks keep it out of the mean, the max and the LM loss. A text longer than
``max_bytes`` is cut before it is read: ``front`` drops its start (keeps the end), ``back`` its end.
The decision threshold picked on dev is folded into the head's last bias, so that ``P ≥ 0.5`` means
positive, as for the probe (``models.classifier.labels_of``).

Single device, no mixed precision or distribution: the job (tasks/finetune/train.py) adds those.
``FinetunedClassifier`` below is what the served MLflow model wraps, with the probe's interface.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from models.classifier import CONFIG_FILE, LABELS, WEIGHTS_FILE, BinaryClassifier, read_config, sigmoid
from models.features import OnBatch, length_batches
from models.mlstm import MLSTM, MLSTMConfig
from models.precision import autocast, feature_precision
from models.text import CLEANING, encode

Pool = Literal["last", "mean", "max", "concat"]
Head = Literal["linear", "mlp"]
Truncate = Literal["front", "back"]
POOLS: tuple[Pool, ...] = ("last", "mean", "max", "concat")
KIND = "finetuned"  # classifier.json's "kind": how models/mlflow_loader.py tells it from a probe


@dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """What sits on the mLSTM: the pooling, the head, its hidden width (mlp), the text's cut."""

    pool: Pool = "last"
    head: Head = "linear"
    mlp_hidden: int = 256
    max_bytes: int = 1024
    truncate: Truncate = "front"


def truncated(data: bytes, max_bytes: int, side: Truncate) -> bytes:
    """At most ``max_bytes`` of an encoded text: ``front`` drops its start, ``back`` its end."""
    if len(data) <= max_bytes:
        return data
    return data[-max_bytes:] if side == "front" else data[:max_bytes]


def batch_bytes(texts: list[str], max_bytes: int, side: Truncate) -> tuple[Tensor, Tensor]:
    """Texts cleaned, encoded, cut and padded at the end with zeros: bytes [B, T] and lengths [B]."""
    encoded = [truncated(encode(text), max_bytes, side) for text in texts]
    lengths = [len(data) for data in encoded]
    bytes_BT = np.zeros((len(encoded), max(lengths, default=1)), dtype=np.int64)
    for b, data in enumerate(encoded):
        bytes_BT[b, : len(data)] = np.frombuffer(data, dtype=np.uint8)
    return torch.from_numpy(bytes_BT), torch.tensor(lengths, dtype=torch.int64)


class FinetuneModel(nn.Module):
    """The mLSTM (its weights from a pretraining checkpoint) and a head on its pooled cell states."""

    def __init__(self, lm: MLSTM, config: HeadConfig) -> None:
        super().__init__()
        self.lm, self.config = lm, config
        H = lm.config.hidden_size
        P = 3 * H if config.pool == "concat" else H
        if config.head == "linear":
            self.head: nn.Module = nn.Linear(P, 1)
        else:
            self.head = nn.Sequential(
                nn.Linear(P, config.mlp_hidden), nn.ReLU(), nn.Linear(config.mlp_hidden, 1)
            )
        # The last layer starts at zero: P = ½ for every text, and no gradient of a random head reaches
        # the mLSTM in the first step (cell states are unnormalised; a random head's logits on them
        # started SST at a loss of 1.5 nats, above chance's 0.69, and the recurrence paid for it).
        nn.init.zeros_(self.last_layer().weight)
        nn.init.zeros_(self.last_layer().bias)

    def pool(self, c_BTH: Tensor, lengths_B: Tensor) -> Tensor:
        """The pooled cell states [B, P] over each text's own bytes."""
        T = c_BTH.shape[1]
        mask_BT1 = (torch.arange(T, device=c_BTH.device) < lengths_B.unsqueeze(1)).unsqueeze(2)
        last_BH = c_BTH[torch.arange(c_BTH.shape[0], device=c_BTH.device), lengths_B - 1]
        if self.config.pool == "last":
            return last_BH
        mean_BH = (c_BTH * mask_BT1).sum(1) / lengths_B.unsqueeze(1).to(c_BTH.dtype)
        if self.config.pool == "mean":
            return mean_BH
        max_BH = c_BTH.masked_fill(~mask_BT1, float("-inf")).amax(1)
        if self.config.pool == "max":
            return max_BH
        return torch.cat([last_BH, mean_BH, max_BH], dim=1)

    def forward(self, bytes_BT: Tensor, lengths_B: Tensor) -> tuple[Tensor, Tensor]:
        """The class logit z [B] and each row's mean next-byte loss over its own bytes [B] (nats)."""
        logits_BTV, _, c_BTH = self.lm(bytes_BT)
        z_B = self.head(self.pool(c_BTH, lengths_B).float()).squeeze(1)
        # Byte t predicts byte t + 1, for the t + 1 < L of each row.
        T = bytes_BT.shape[1]
        predicts_BT = torch.arange(T - 1, device=bytes_BT.device) < (lengths_B - 1).unsqueeze(1)
        ce_BT = F.cross_entropy(
            logits_BTV[:, :-1].float().flatten(0, 1), bytes_BT[:, 1:].flatten(), reduction="none"
        ).view(bytes_BT.shape[0], T - 1)
        lm_B = (ce_BT * predicts_BT).sum(1) / predicts_BT.sum(1).clamp(min=1)
        return z_B, lm_B

    def fold_threshold(self, logit_threshold: float) -> None:
        """z - τ: ``P ≥ 0.5`` then means ``z ≥ τ``, the threshold chosen on dev."""
        with torch.no_grad():
            self.last_layer().bias.sub_(logit_threshold)

    def last_layer(self) -> nn.Linear:
        last = self.head if isinstance(self.head, nn.Linear) else list(self.head.children())[-1]
        assert isinstance(last, nn.Linear)
        return last

    @torch.no_grad()
    def logits(
        self,
        texts: list[str],
        *,
        batch_size: int = 64,
        precision: str = "auto",
        on_batch: OnBatch | None = None,
    ) -> np.ndarray:
        """The class logit z of each text [N] (float64), in input order; similar lengths batched together;
        the products in ``precision`` (``models.precision.feature_precision``: auto is fp32 on a CPU).
        ``on_batch(texts, bytes)`` after each batch, as the features path tells it: a scoring piece's bar
        moves, and a stop requested there is seen, batch by batch, not once at the end."""
        self.eval()
        device = next(self.parameters()).device
        dtype = feature_precision(precision, device)
        encoded_lengths = [
            len(truncated(encode(t), self.config.max_bytes, self.config.truncate)) for t in texts
        ]
        z_N = np.zeros(len(texts), dtype=np.float64)
        for rows in length_batches(encoded_lengths, batch_size):
            bytes_BT, lengths_B = batch_bytes(
                [texts[r] for r in rows], self.config.max_bytes, self.config.truncate
            )
            with autocast(device, dtype):
                z_B, _ = self(bytes_BT.to(device), lengths_B.to(device))
            z_N[rows] = z_B.double().cpu().numpy()
            if on_batch is not None:
                on_batch(len(rows), int(lengths_B.sum()))
        return z_N


@dataclass
class FinetunedClassifier(BinaryClassifier):
    """The served fine-tuned model: ``predict`` and ``predict_proba`` as ``SentimentClassifier`` has
    them, saved the same way (an ``.npz`` of weights and a ``classifier.json``, no pickles)."""

    model: FinetuneModel
    info: dict[str, Any] = field(default_factory=dict)  # where it came from: checkpoint, dataset, settings

    def __post_init__(self) -> None:
        self.model.eval()

    def predict_proba(
        self,
        texts: list[str],
        *,
        batch_size: int = 64,
        precision: str = "auto",
        on_batch: OnBatch | None = None,
    ) -> np.ndarray:
        """P(positive) for each text, in input order."""
        return sigmoid(
            self.model.logits(texts, batch_size=batch_size, precision=precision, on_batch=on_batch)
        )

    def save(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {name: t.detach().cpu().float().numpy() for name, t in self.model.state_dict().items()}
        np.savez(folder / WEIGHTS_FILE, **arrays)
        config = {
            "kind": KIND,
            "model": asdict(self.model.lm.config),
            "head": asdict(self.model.config),
            "cleaning": CLEANING,
            "labels": LABELS,
            **self.info,
        }
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        return folder

    @classmethod
    def load(cls, folder: Path, *, device: torch.device | str = "cpu") -> FinetunedClassifier:
        config = read_config(folder)
        model = FinetuneModel(MLSTM(MLSTMConfig(**config.pop("model"))), HeadConfig(**config.pop("head")))
        with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as arrays:
            model.load_state_dict({k: torch.from_numpy(arrays[k]) for k in arrays.files})
        info = {k: v for k, v in config.items() if k not in ("kind", "cleaning", "labels")}
        return cls(model.to(device), info)


def is_finetuned(folder: Path) -> bool:
    """Whether a saved classifier's folder holds a fine-tuned model (else a probe)."""
    return bool(json.loads((folder / CONFIG_FILE).read_text()).get("kind") == KIND)
