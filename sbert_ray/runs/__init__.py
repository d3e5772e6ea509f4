"""The orchestration layer: what Ray and MLflow do for each kind of run.

- ``train_run``: one training run in phases (preflight -> open run -> score before -> fit -> finish), ``scoring``
  its evaluations as Ray tasks on a training worker's resources, ``record`` and ``run_lease`` what a run remembers
  and who runs it, ``owned_paths`` what it may write or replace (and the outputs encode and mine resume);
- ``eval_run``: ``sbert-ray eval`` (scoring a given model, optionally as an MLflow run);
- ``argsim_folds``: cross-validated argument-similarity fine-tuning (a training run per fold);
- ``sweep``: a Ray Tune sweep whose trials are training runs;
- ``encode_corpus``: ``sbert-ray encode`` on Ray Data;
- ``mine_negatives``: ``sbert-ray mine`` (hard negatives on Ray actors);
- ``cluster``: checking the resources a run asks for and sizing how many runs fit at once (joining Ray is
  ``sbert_ray.ray_compat.connect_ray``); ``progress_lines`` what the driver prints while Ray works.

Nothing below this package imports it: workers only train and report, evaluators only score.
"""
