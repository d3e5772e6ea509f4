"""The orchestration layer: what Ray and MLflow do for each kind of run.

- ``training``: one training run (config check, MLflow run, "before" and final evaluation, the TorchTrainer);
- ``argsim``: cross-validated argument-similarity fine-tuning (a training run per fold);
- ``sweep``: a Ray Tune sweep whose trials are training runs;
- ``evaluation``: scoring a model as a Ray task on a training worker's resources;
- ``cluster``: joining Ray and sizing how many runs fit at once.

Nothing below this package imports it: workers only train and report, evaluators only score.
"""
