"""Hyperparameter search over the pretraining job: a spec, the ASHA rungs on Optuna, trial bookkeeping.

Plain work without Prefect: ``flows/sweep.py`` wires it to Prefect runs, the CLI to a terminal.
"""
