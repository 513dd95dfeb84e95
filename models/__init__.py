"""Model code: the byte encoding of text, the mLSTM, its features and the classifier.

Nothing here imports from ``tasks`` or ``flows``: the served classifier needs only this package.
"""
