"""MLflow's loader for the served classifier (``loader_module``): the code that scores is this installed
package, never code stored with the model. The logged model's artifact holds data only: the classifier's
``.npz`` of weights and its ``classifier.json``.

The project's own readers (``predict``, ``score``, ``explain``, the transfer stage's champion) call
``load_served`` on the artifact's data folder themselves (``tasks/registered.py``), so what the
artifact's ``MLmodel`` names cannot change the code they run. ``mlflow models serve`` and
``mlflow.pyfunc.load_model`` follow ``MLmodel`` and so trust whoever can write the artifact root
(docs/operations.md, "Who may write what").
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from models.classifier import SentimentClassifier
from models.finetuned import FinetunedClassifier, is_finetuned
from models.serving import SentimentModel, guard_scoring_server

PACKAGE = "mlstm-sentiment"
VERSION_KEY = "package_version"  # in classifier.json and the MLmodel metadata: the package that logged it


def installed_version() -> str:
    try:
        return version(PACKAGE)
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "0"


def _load_pyfunc(data_path: str) -> SentimentModel:
    """What ``mlflow.pyfunc.load_model`` calls with the model's data folder (and, in ``mlflow models
    serve``, the guard that refuses a text the server's parser would cast to a string)."""
    guard_scoring_server()
    return load_served(Path(data_path))


def load_served(folder: Path) -> SentimentModel:
    """The served model of a classifier's saved folder, built by this installed package from data only
    (the project's own readers call this directly, never MLflow's flavour dispatch)."""
    # A probe on the frozen mLSTM, or the mLSTM fine-tuned with its head: the same interface.
    classifier = (
        FinetunedClassifier.load(folder) if is_finetuned(folder) else SentimentClassifier.load(folder)
    )
    served = SentimentModel(classifier)
    logged = str(served.classifier.info.get(VERSION_KEY, "0"))
    if _release(logged) > _release(installed_version()):
        raise RuntimeError(
            f"this model was logged by {PACKAGE} {logged}, newer than the installed {installed_version()}: "
            f"install {PACKAGE} {logged} or later to load it"
        )
    return served


def _release(text: str) -> tuple[int, ...]:
    """``0.1.0`` → (0, 1, 0); a suffix (``.dev3``, ``+local``) does not count."""
    parts = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
