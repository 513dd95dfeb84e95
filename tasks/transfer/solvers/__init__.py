"""The probe's L1 logistic-regression path solvers besides liblinear (scikit-learn's, the reference):
``newton`` (warm-started working-set proximal Newton, the default) and ``fista`` (warm-started
accelerated proximal gradient, the ``--solver torch`` of the transfer stage). Both solve liblinear's
objective, the intercept penalised too, on CPU threads or a GPU; ``tasks/transfer/probe.py`` picks one."""
