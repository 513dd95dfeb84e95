"""The fine-tuning stage: takes a pretraining checkpoint and a labelled dataset and hands on a
fine-tuned classifier (the mLSTM and a head trained together), registered as a challenger."""
