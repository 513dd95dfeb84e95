"""Model code: the byte encoding of text and (later) the mLSTM and the classifier.

Nothing here imports from ``tasks`` or ``flows``: the served classifier needs only this package.
"""
