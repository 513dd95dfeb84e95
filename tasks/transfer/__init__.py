"""The transfer stage: takes a checkpoint URI and labelled datasets and hands on probes, the sentiment
neuron and a registered classifier (an MLflow model version), ready to serve."""
