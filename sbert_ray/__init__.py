"""Sentence-BERT training and evaluation on Ray Train / Tune, tracked in MLflow."""
