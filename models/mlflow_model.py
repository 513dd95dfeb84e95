"""MLflow's "model from code" entry for the served classifier: MLflow runs this file to build it."""

from mlflow.models import set_model

from models.serving import SentimentModel

set_model(SentimentModel())
