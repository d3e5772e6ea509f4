"""The config dataclasses (what a training run's YAML holds, with each key's meaning beside its field) and their
checks: ``validate()`` checks choices and ranges, naming the key, so a bad config fails before any Ray work starts.
A stage's ``loss:`` settings are checked against its objective's loss class in the objective registry
(``sbert_ray.losses.registry``), last: the registry imports torch, and every other error answers without it (in
well under a second)."""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Literal

from sbert_ray.config.conversion import ConfigError, check_choice, convert_value
from sbert_ray.models.attention import AttentionImplementation
from sbert_ray.models.lora_settings import LoraSettings
from sbert_ray.models.model_type import ModelType
from sbert_ray.models.pooling_mode import PoolingMode


@dataclass
class ModelConfig:
    # A local folder, a Hub id, or "random:<shape>" (tiny|mini|small|base) for a randomly initialised BERT.
    name: str = "sentence-transformers/all-MiniLM-L6-v2"
    # bi_encoder: a sentence encoder (transformer + pooling), embedding each text alone; cross_encoder: a reranker
    # (a sequence-classification head with one label) scoring each (query, passage) pair read together, trained
    # with the reranker_* objectives and saved as sentence-transformers' CrossEncoder (docs/retrieval.md)
    type: ModelType = "bi_encoder"
    pooling: PoolingMode | None = None  # None keeps the model's own pooling (mean for a plain Hugging Face model)
    max_seq_length: int = 128  # tokens per text; longer texts are truncated (and counted in the training log)
    normalize: bool | None = None  # L2-normalise the embeddings; None keeps the saved model's setting
    # Weights are read from safetensors files only; True also allows pickled PyTorch files (pytorch_model.bin),
    # which can run code when loaded: only for models from a source you trust.
    allow_unsafe_weights: bool = False
    # Texts put before the inputs, by name, as sentence-transformers' prompts: e.g. {query: "query: ", document:
    # "passage: "}. Training puts the query prompt before the anchor column and the document prompt before the
    # others; retrieval evaluation before the queries and the corpus. Saved with the model. None keeps the model's.
    prompts: dict[str, str] | None = None
    # The prompt of an input that names none (sentence-transformers' default_prompt_name); a key of prompts.
    # None: the model's own when prompts is None, else no default.
    default_prompt_name: str | None = None
    # transformers' attention kernels: sdpa (PyTorch's fused attention), eager, or flash_attention_2 (needs the
    # flash-attn package and CUDA GPUs on the workers; refused before training where the package is missing)
    attn_implementation: AttentionImplementation = "sdpa"
    # Recompute each layer's activations in the backward pass instead of keeping them: less memory for long inputs
    # and large models, about a third more compute per step
    gradient_checkpointing: bool = False
    # Train LoRA adapters instead of every weight ({r, alpha, dropout, target_modules}; docs/using-models.md#lora):
    # the final model is saved merged, with the adapter in its adapter/ folder. None: full fine-tuning
    lora: LoraSettings | None = None


@dataclass
class DatasetSource:
    """One of several datasets a stage draws its batches from (``stages.<i>.datasets``)."""

    name: str | None = None  # a registered dataset (see sbert_ray.data); or give path
    path: str | None = None  # a csv/tsv/jsonl/parquet file, a folder or glob of shards, or an s3:// prefix
    split: str = "train"  # the split of a registered dataset
    columns: dict[str, str] | None = None  # for files: record field -> column name
    weight: float = 1.0  # proportional sampling: draws this x its batches per epoch (2: twice over, 0.5: half)


@dataclass
class StageConfig:
    """One training stage: a dataset and an objective (the paper trains NLI, then STSb, in two stages)."""

    # A registered name (see sbert_ray.data), or the user's data: a csv/tsv/jsonl/parquet file, a folder or glob of
    # shards, or an object-storage prefix (s3://bucket/shards/); streamed through Ray Data, never read whole
    dataset: str = "stsb"
    split: str = "train"  # the split of a registered dataset
    columns: dict[str, str] | None = None  # for user files: record field -> column name
    datasets: list[DatasetSource] | None = None  # several datasets instead of `dataset`: each batch from one of them
    sampling: Literal["proportional", "round_robin"] = "proportional"  # how batches are drawn from `datasets`
    # Smart batching window: this many global micro-batches' worth of a worker's rows (its shares of them) are sorted
    # by length together. Larger pads less and shuffles wider; it is also how much of the stream a worker holds, and
    # what it skips on a short pass.
    window_batches: int = 200
    # Each pass reads the stage's files (shards) in a seeded order of its own, and a prepared source's row groups
    # within each shard too (seed, source, pass); false: the listed order every pass. Rows within a row group or a
    # csv/tsv/jsonl file keep their order (until the window sorts them)
    shuffle_files: bool = True
    # No text twice in a worker's batch (a row that would repeat one waits for the next batch); None: on for
    # in-batch-negative objectives (mnrl, cached_mnrl), where a duplicate would be its own false negative
    no_duplicates: bool | None = None
    limit: int | None = None  # use only the first N examples of each pass's order (smoke runs); None = all
    errors: Literal["raise", "skip"] = "raise"  # a bad row stops the run, or is skipped, counted and logged
    score_max: float = 5.0  # score targets are score / score_max (STSb's 0-5 -> 0-1, as in the paper)
    objective: str = "regression"  # a name in sbert_ray.losses.registry.OBJECTIVES
    loss: dict[str, Any] = field(default_factory=dict)  # the objective's settings, e.g. {concat: [u, v, "|u-v|"]}
    matryoshka_dims: list[int] | None = None  # train the objective at each of these embedding sizes at once
    matryoshka_weights: list[float] | None = None  # one per size; default 1 each
    epochs: int = 1  # passes over the stage's data
    max_steps: int | None = None  # stop the stage after this many optimizer steps; None = run every epoch
    # Global batch (summed over workers and accumulation steps): dealt over however many workers train, the first
    # ranks one example more where it does not divide (16 over 3: 6, 5, 5), the loss weighted by each rank's rows,
    # so a step is the same at any worker count; it needs batch_size >= num_workers (max) * grad_accum_steps.
    batch_size: int = 16
    grad_accum_steps: int = 1  # micro-batches per optimizer step (a divisor of batch_size)
    learning_rate: float = 2e-5  # AdamW's peak rate, reached after warm-up, then decayed linearly to 0
    adam_eps: float = 1e-6  # AdamW's epsilon
    weight_decay: float = 0.01  # AdamW's decoupled weight decay (not on biases and LayerNorm weights)
    warmup_ratio: float = 0.1  # share of the stage's optimizer steps with a linear warm-up
    max_grad_norm: float = 1.0  # gradients are clipped to this global norm before each step


@dataclass
class DevTaskConfig:
    """One task of a multi-task dev score (``evaluation.dev_tasks``)."""

    task: str = ""  # any one task --tasks takes, e.g. stsb-retrieval:dev or retrieval:/path/to/beir-folder
    metric: str | None = None  # as the task reports it; None: the task's primary metric
    weight: float = 1.0  # its share of the weighted mean (weights need not sum to 1)


@dataclass
class EvalConfig:
    dev_dataset: str = "stsb"  # scored on every checkpoint (unless dev_task): its Spearman picks the best checkpoints
    dev_split: str = "dev"  # the split of dev_dataset
    dev_limit: int | None = None  # score only the first N dev pairs; None = all
    # An evaluation task scored on every checkpoint instead of the dev pairs, e.g. stsb-retrieval:dev or
    # retrieval:/path/to/beir-folder (any one task --tasks takes); its dev_metric picks the best checkpoints and a
    # sweep's best trial, and drives ASHA. None: the dev pairs of dev_dataset / dev_split.
    dev_task: str | None = None
    # The metric of the dev task (or of the dev pairs) that does so, named as the task reports it, e.g.
    # ndcg_at_10_cosine or spearman_cosine (a reranker's dev pairs: spearman_pair_score or pearson_pair_score, its
    # scores against the gold ones); logged as dev/<metric>. None: the task's primary metric.
    dev_metric: str | None = None
    # Several tasks instead: each logged as dev/<task>/<metric>, and their weighted mean (dev/weighted_mean) is the
    # dev score. Replaces dev_task/dev_metric and the dev pairs.
    dev_tasks: list[DevTaskConfig] = field(default_factory=list)
    eval_every: int = 0  # optimizer steps between dev evaluations; 0 = only at the end of each stage
    batch_size: int = 64  # sentences per encoding batch when scoring
    # Where each checkpoint's dev score is computed. true: off the training ranks, in a Ray task on dev_resources
    # while training goes on (Ray Train's checkpoint validation); keep_best re-ranks a checkpoint when its score
    # arrives, MLflow gets it at the checkpoint's step, and a sweep's scheduler gets it at the trial's next report
    # (a lag of one report). false: inline on rank 0, training waits. auto: true where the cluster holds
    # dev_resources beside the training workers (a sweep: beside as many trials as it would run without them),
    # false otherwise; decided before the fit and said in the log.
    async_dev: Literal["auto", True, False] = "auto"
    # What the off-rank dev scorer reserves: CPUs, and a GPU or a fraction of one (e.g. {CPU: 1, GPU: 0.25}) where
    # the cluster has one beside the training workers' GPUs; it scores on that GPU, else on its CPUs.
    dev_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    # Off the ranks: how many scorers share each dev score's encoding, each on dev_resources (whole batches dealt
    # round-robin, the scores those of one process), for a dev corpus one scorer would not score within a report
    # interval. 1: one scorer. Inline on rank 0 the dev score is rank 0's alone.
    dev_workers: int = 1
    final_tasks: list[str] = field(default_factory=lambda: ["sts"])  # [] skips the final suite
    before_tasks: list[str] = field(default_factory=list)  # tasks scored on the model before training
    # A reranker's (model.type cross_encoder) final tasks are rerank:<set> tasks: this bi-encoder (a folder or Hub
    # id) retrieves each query's top 100 and the trained reranker reorders them, as sbert-ray eval --reranker does
    # (ndcg_at_10 and the rest, first stage and reranked). None: no such tasks.
    first_stage: str | None = None


# How long work waits for CPUs/GPUs other work holds (scaling.resource_wait_s, the commands' --resource-wait-s).
RESOURCE_WAIT_S = 600.0


@dataclass
class ScalingConfig:
    # Ray Train workers, i.e. data-parallel ranks (each its share of every global batch). [min, max]: elastic, the
    # run starts on as many as the cluster holds up to max, goes on with at least min when nodes are lost and grows
    # back when they return (each resize restarts the workers from the latest full-state checkpoint); the global
    # batch, the data order's position, the learning-rate schedule and the step count stay the configured ones.
    num_workers: int | list[int] = 1
    use_gpu: bool = False  # train on GPUs (NCCL); else on CPUs (gloo)
    cpus_per_worker: float = 1.0  # CPUs Ray reserves for each worker
    gpus_per_worker: float = 1.0  # GPUs Ray reserves for each worker when use_gpu (a fraction only with one worker)
    torch_threads: int | None = None  # per worker; None = cpus_per_worker rounded up
    # Ray placement strategy of the workers: SPREAD puts them on different nodes where it can
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Training arithmetic. auto: on a GPU bf16 autocast where it has bf16 (Ampere and later), else fp16 autocast
    # with a gradient scaler (V100, T4); on CPUs fp32, so published numbers stay exact. Weights and optimizer
    # state stay fp32 in every mode.
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # How long a run waits for its workers' CPUs/GPUs while other work holds them (or an autoscaler starts nodes for
    # them, which takes minutes), before it fails naming what is missing. A request the cluster can never hold (more
    # than its nodes, or its autoscaler's maximum) fails at once.
    resource_wait_s: float = RESOURCE_WAIT_S
    # torch.compile the transformer's training forward (inductor): faster steps on a GPU after a compile per batch
    # shape (seconds to minutes each; on GPUs widths are padded to a few buckets, docs/performance.md, so a run
    # compiles a bounded number of graphs). auto: on GPUs (use_gpu), not on CPUs, where the compilation costs more
    # than it gains; false opts out (e.g. short runs, debugging); true compiles on CPUs too.
    compile: bool | Literal["auto"] = "auto"
    # How the workers share the model. ddp: each holds all of it (parameters, gradients, AdamW state: 16 bytes per
    # parameter before activations) and gradients are all-reduced. fsdp: each holds 1/num_workers of them (torch's
    # FSDP2, per transformer layer), gathering a layer's parameters while it computes: for models one device cannot
    # hold whole with their optimizer state (docs/large-models.md). Checkpoints are whole either way.
    strategy: Literal["ddp", "fsdp"] = "ddp"

    @property
    def min_workers(self) -> int:
        """The fewest workers a run trains on (``num_workers`` when it is one number)."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        """The most workers a run trains on: the world size the stages' batch sizes are configured at."""
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[-1]

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers

    def ray_num_workers(self) -> int | tuple[int, int]:
        """``ray.train.ScalingConfig(num_workers=...)``: a (min, max) tuple runs Train v2's elastic scaling policy."""
        return (self.min_workers, self.max_workers) if self.elastic else self.max_workers

    def resources_per_worker(self) -> dict[str, float]:
        """What each training worker asks Ray for."""
        return {"CPU": self.cpus_per_worker, **({"GPU": self.gpus_per_worker} if self.use_gpu else {})}

    def threads_per_worker(self) -> int:
        """Torch threads of each training worker (and of the evaluation that runs on a worker's resources)."""
        return self.torch_threads or max(1, math.ceil(self.cpus_per_worker))


@dataclass
class CheckpointConfig:
    storage_path: str = "~/sbert-ray/runs"  # stable across jobs so a resubmitted run resumes
    keep_best: int = 2  # models kept by the dev score (evaluation.dev_metric), besides the latest
    max_failures: int = 2  # worker restarts from the latest resume point; -1 = no limit (Ray's meaning)
    # Report points between full-state checkpoints (weights, optimizer, scheduler, stream position, random state):
    # resume points, the two newest kept in the run folder's resume_points/ apart from keep_best, which a restarted
    # or resubmitted run resumes from. Every report point's model is kept by keep_best. The end of every stage is
    # always full. 1: all full.
    full_every: int = 1
    # How a checkpoint reaches storage_path. async: the report point copies it to host memory and training goes on
    # while it is written and uploaded in the background (one at a time, committed in report order); sync: the
    # report point waits until it is stored (what `sbert-ray bench train --reports sync` compares with).
    upload: Literal["async", "sync"] = "async"


@dataclass
class TrackingConfig:
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite under ~/sbert-ray/mlflow
    experiment: str = "sbert-ray"  # the MLflow experiment of the run
    run_name: str | None = None  # the MLflow run's name; None: the config's name
    registered_model_name: str | None = None  # register the final model as a new version of this MLflow model
    alias: str | None = None  # and point this alias (e.g. "champion") at that version
    # How long the driver waits for a tracking store that stopped answering before it gives up (training itself
    # never waits: rank 0 keeps its metrics in a file of the run until the store answers again).
    wait_s: float = 600.0

    def validate(self) -> None:
        """MLflow's rules for registered model names and aliases, checked before any work starts."""
        if not self.wait_s >= 0:  # also refuses NaN
            raise ConfigError(f"tracking.wait_s must be >= 0, got {self.wait_s}")
        name, alias = self.registered_model_name, self.alias
        if name is not None and (not name.strip() or any(c in name for c in "/:")):
            raise ConfigError(f"tracking.registered_model_name: {name!r} must be non-empty without '/' or ':'")
        if alias is None:
            return
        if name is None:
            raise ConfigError("tracking.alias needs tracking.registered_model_name: an alias names a model version")
        if not re.fullmatch(r"[\w-]+", alias) or alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
            raise ConfigError(
                f"tracking.alias: {alias!r} must be letters, digits, '_' or '-', and not 'latest' or 'v<number>' "
                "(MLflow reserves those for versions)"
            )


@dataclass
class TrainConfig:
    name: str = "sbert"  # the run's name: checkpoints live in <storage_path>/<name>; resubmitting resumes
    seed: int = 42  # seeds torch, numpy and Python on every worker, random model weights and data order
    data_dir: str | None = None  # default: $SBERT_RAY_DATA_DIR, else the Hugging Face Hub
    output_dir: str | None = None  # where the final model is written; default <storage_path>/<name>/final-model
    model: ModelConfig = field(default_factory=ModelConfig)  # the encoder to train
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])  # trained in order, in one run
    evaluation: EvalConfig = field(default_factory=EvalConfig)  # dev scoring during training, tasks before and after
    scaling: ScalingConfig = field(default_factory=ScalingConfig)  # workers, their resources and arithmetic
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # where checkpoints live, how many stay
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # the MLflow store, experiment and registry

    def validate(self) -> None:
        """Check what the types cannot say, naming the key; normalises each stage's ``loss`` settings to their declared
        types. Integer and positivity checks come before any arithmetic on the values (a zero worker count must be
        an error here, not a ZeroDivisionError further down)."""
        check_folder_name("name", self.name, "checkpoints live in <storage_path>/<name>")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")
        if not self.model.name.strip():  # '' would load the working directory as a model folder
            raise ConfigError("model.name: empty; give a Hub id, a model folder or random:<shape>")
        _at_least("model.max_seq_length", self.model.max_seq_length, 1)
        if self.model.prompts is not None and self.model.default_prompt_name not in (None, *self.model.prompts):
            raise ConfigError(
                f"model.default_prompt_name: {self.model.default_prompt_name!r} is not a key of model.prompts "
                f"({', '.join(self.model.prompts) or 'none'})"
            )
        self._validate_model_type()
        lora_problem = self.model.lora.problem("model.lora") if self.model.lora else None
        if lora_problem:
            raise ConfigError(lora_problem)
        self._validate_scaling()
        if not self.stages:
            raise ConfigError("stages: at least one training stage is required")
        for i, stage in enumerate(self.stages):
            self._validate_stage(f"stages.{i}", stage)
        self._validate_strategy()
        evaluation = self.evaluation
        _at_least("evaluation.dev_limit", evaluation.dev_limit, 2, none_means="all dev pairs")  # Spearman needs 2
        _check_dev_task(evaluation)
        _check_dev_resources(evaluation.dev_resources)
        _at_least("evaluation.dev_workers", evaluation.dev_workers, 1)
        _at_least("evaluation.eval_every", evaluation.eval_every, 0)
        _at_least("evaluation.batch_size", evaluation.batch_size, 1)
        _at_least("checkpoint.keep_best", self.checkpoint.keep_best, 1)
        _at_least("checkpoint.max_failures", self.checkpoint.max_failures, -1)
        _at_least("checkpoint.full_every", self.checkpoint.full_every, 1)
        self.tracking.validate()
        for i, stage in enumerate(self.stages):  # last: the objective registry imports torch
            stage.loss = _objective_settings(f"stages.{i}", stage, self.model.type)
        self._validate_reranker_evaluation()

    def _validate_model_type(self) -> None:
        """A reranker has no pooling, embedding or prompts: settings of those would be silently unused."""
        if self.model.type != "cross_encoder":
            return
        defaults = ModelConfig()
        for name in ("pooling", "normalize", "prompts", "default_prompt_name", "gradient_checkpointing", "lora"):
            if getattr(self.model, name) != getattr(defaults, name):
                raise ConfigError(
                    f"model.{name}: a bi-encoder setting, which model.type cross_encoder has not; leave it out"
                )

    def _validate_reranker_evaluation(self) -> None:
        """A reranker's dev score is its dev pairs' (``evaluation.dev_score``); the evaluation tasks (but final
        rerank: tasks, which rerank ``evaluation.first_stage``'s candidates: checked once parsed, ``RunTasks.parse``),
        the dev scorers' encoder pool and MLflow's model registry take bi-encoders only."""
        evaluation, why = self.evaluation, "which model.type cross_encoder has not"
        if self.model.type != "cross_encoder":
            if evaluation.first_stage is not None:
                raise ConfigError(
                    "evaluation.first_stage: the retriever of a reranker's rerank: tasks (model.type cross_encoder); "
                    "a bi-encoder's tasks rank by its own embeddings: leave it out"
                )
            return
        if evaluation.before_tasks:
            raise ConfigError(
                f"evaluation.before_tasks: {evaluation.before_tasks} score embeddings, {why}; set before_tasks: [] "
                "(a reranker's dev score is scored at every checkpoint)"
            )
        if evaluation.first_stage is not None and not evaluation.final_tasks:
            raise ConfigError("evaluation.first_stage: no final rerank: task uses it; leave it out")
        for name in ("dev_task", "dev_tasks"):
            if getattr(evaluation, name):
                raise ConfigError(
                    f"evaluation.{name}: evaluation tasks score embeddings, {why}; a reranker's dev score is its "
                    "dev pairs' (evaluation.dev_dataset): leave it out"
                )
        if evaluation.dev_workers != 1:
            raise ConfigError(f"evaluation.dev_workers: the scorers' pool shares encoding, {why}; leave it out")
        if self.tracking.registered_model_name is not None:
            raise ConfigError(
                "tracking.registered_model_name: a reranker is logged as the run's artifacts (model/), not as an "
                "MLflow model to register; leave it out"
            )

    def _validate_scaling(self) -> None:
        scaling = self.scaling
        if isinstance(scaling.num_workers, list):
            if len(scaling.num_workers) != 2:
                raise ConfigError(f"scaling.num_workers: a number or [min, max], got {scaling.num_workers}")
            if scaling.min_workers > scaling.max_workers:
                raise ConfigError(f"scaling.num_workers: [min, max] needs min <= max, got {scaling.num_workers}")
        _at_least("scaling.num_workers", scaling.min_workers, 1)
        _at_least("scaling.torch_threads", scaling.torch_threads, 1, none_means="cpus_per_worker rounded up")
        _greater("scaling.cpus_per_worker", scaling.cpus_per_worker, 0)
        _greater("scaling.gpus_per_worker", scaling.gpus_per_worker, 0)
        if not scaling.resource_wait_s >= 0:  # also refuses NaN
            raise ConfigError(f"scaling.resource_wait_s must be >= 0, got {scaling.resource_wait_s}")
        gpus = scaling.gpus_per_worker
        if scaling.use_gpu and gpus > 1 and not float(gpus).is_integer():
            raise ConfigError(f"scaling.gpus_per_worker: more than one GPU must be a whole number, got {gpus}")
        if scaling.use_gpu and scaling.max_workers > 1 and gpus < 1:
            # Ray would pack several ranks onto one GPU, and NCCL refuses two ranks on the same device.
            raise ConfigError(
                f"scaling.gpus_per_worker: {gpus} GPU per worker with scaling.num_workers={scaling.num_workers} "
                "would put several workers on one GPU, which NCCL refuses; use 1 or more"
            )

    def _validate_strategy(self) -> None:
        """FSDP shards the encoder only: an objective's own trainable head would train unaveraged on each worker."""
        from sbert_ray.losses.registry import OBJECTIVES  # torch: the stages were checked against it already

        if self.scaling.strategy != "fsdp":
            return
        for i, stage in enumerate(self.stages):
            if OBJECTIVES[stage.objective].has_head:
                raise ConfigError(
                    f"stages.{i}.objective: {stage.objective} trains a head beside the encoder, which "
                    "scaling.strategy: fsdp does not shard; use scaling.strategy: ddp"
                )

    def _validate_stage(self, key: str, stage: StageConfig) -> None:
        for name in ("epochs", "batch_size", "grad_accum_steps"):
            _at_least(f"{key}.{name}", getattr(stage, name), 1)
        _matryoshka(key, stage.matryoshka_dims, stage.matryoshka_weights)
        for name in ("limit", "max_steps"):  # 0 is not "no limit": that is null
            _at_least(f"{key}.{name}", getattr(stage, name), 1, none_means="no limit")
        for name in ("learning_rate", "adam_eps", "max_grad_norm", "score_max"):
            _greater(f"{key}.{name}", getattr(stage, name), 0)
        _at_least(f"{key}.weight_decay", stage.weight_decay, 0)
        _at_least(f"{key}.window_batches", stage.window_batches, 1)
        for j, source in enumerate(stage.datasets or []):
            if (source.name is None) == (source.path is None):
                which = "both" if source.name else "neither"
                raise ConfigError(f"{key}.datasets.{j}: give either name or path, not {which}")
            _greater(f"{key}.datasets.{j}.weight", source.weight, 0)
        if stage.datasets == []:
            raise ConfigError(f"{key}.datasets: an empty list; give datasets or leave it out for `dataset`")
        if not 0 <= stage.warmup_ratio < 1:
            raise ConfigError(f"{key}.warmup_ratio must be in [0, 1), got {stage.warmup_ratio}")
        # The global micro-batch (batch_size / grad_accum_steps examples) is dealt over however many workers train,
        # uneven where it must be (training.batches.split_batch): only fewer examples than workers cannot be.
        if stage.batch_size % stage.grad_accum_steps:
            raise ConfigError(
                f"{key}.batch_size={stage.batch_size} is the global batch and must be divisible by "
                f"{key}.grad_accum_steps={stage.grad_accum_steps} (the micro-batches of an optimizer step)"
            )
        workers = self.scaling.max_workers
        if stage.batch_size // stage.grad_accum_steps < workers:
            raise ConfigError(
                f"{key}.batch_size={stage.batch_size} is the global batch and must hold at least one example per "
                f"worker and accumulation step: scaling.num_workers * grad_accum_steps = "
                f"{workers * stage.grad_accum_steps} (scaling.num_workers={self.scaling.num_workers})"
            )


MAX_NAME_BYTES = 200  # file names stop at 255 bytes; room for the suffixes added to a run's folder name


def check_folder_name(key: str, name: str, why: str) -> None:
    """``name`` is used as one folder name as it is: a ConfigError naming ``key`` for anything that is not."""
    problem = _folder_name_problem(name)
    if problem:
        raise ConfigError(f"{key}: {name!r} must be a folder name: it {problem} ({why})")


def _folder_name_problem(name: str) -> str | None:
    if not name:
        return "is empty"
    if name in (".", ".."):
        return "is '.' or '..'"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if any(unicodedata.category(c) == "Cc" for c in name):  # NUL, newline, escape, ...
        return "holds a control character"
    try:
        size = len(name.encode())
    except UnicodeEncodeError:  # a lone surrogate, which YAML's "\ud800" escape gives
        return "is not valid Unicode"
    return f"is {size} bytes long (at most {MAX_NAME_BYTES})" if size > MAX_NAME_BYTES else None


def _check_dev_task(evaluation: EvalConfig) -> None:
    """A dev task replaces the dev pairs, and dev tasks replace both: settings of what is replaced would be silently
    unused. Each of the dev tasks names its task and weighs more than nothing."""
    if evaluation.dev_tasks:
        replaced, by = ("dev_task", "dev_metric", "dev_dataset", "dev_split", "dev_limit"), "evaluation.dev_tasks"
    elif evaluation.dev_task is not None:
        replaced, by = ("dev_dataset", "dev_split", "dev_limit"), f"evaluation.dev_task ({evaluation.dev_task!r})"
    else:
        return
    defaults = EvalConfig()
    for name in replaced:
        if getattr(evaluation, name) != getattr(defaults, name):
            raise ConfigError(f"evaluation.{name} is replaced by {by}; leave it out")
    for i, part in enumerate(evaluation.dev_tasks):
        if not part.task:
            raise ConfigError(f"evaluation.dev_tasks.{i}.task: required (a task, e.g. stsb-retrieval:dev)")
        if not part.weight > 0:
            raise ConfigError(f"evaluation.dev_tasks.{i}.weight: must be > 0, got {part.weight}")


def _objective_settings(key: str, stage: StageConfig, model_type: str) -> dict[str, Any]:
    """The stage's objective checked against the registry (with what it cannot be combined with: among others a
    model of the other type), and its ``loss`` settings against (and converted to) the loss class's keyword
    arguments."""
    from sbert_ray.losses.registry import OBJECTIVES, loss_settings  # torch: only once everything else is valid

    check_choice(f"{key}.objective", stage.objective, tuple(OBJECTIVES))
    trains = OBJECTIVES[stage.objective].model_type
    if trains != model_type:
        fitting = ", ".join(name for name, loss in OBJECTIVES.items() if loss.model_type == model_type)
        raise ConfigError(
            f"{key}.objective: {stage.objective!r} trains a {trains} and model.type is {model_type}; "
            f"set model.type: {trains}, or use one of: {fitting}"
        )
    if stage.matryoshka_dims and trains == "cross_encoder":
        raise ConfigError(f"{key}.matryoshka_dims: a reranker has no embedding to truncate; leave it out")
    if stage.matryoshka_dims and OBJECTIVES[stage.objective].label_field == "vector":
        raise ConfigError(
            f"{key}.matryoshka_dims: objective {stage.objective!r} regresses the whole embedding onto a teacher's "
            "of that size, so its prefixes have no target; leave matryoshka_dims out"
        )
    declared = loss_settings(stage.objective)
    unknown = sorted(set(stage.loss) - set(declared))
    if unknown:
        known = ", ".join(declared) or "none"
        raise ConfigError(
            f"unknown key {key}.loss.{unknown[0]!r} for objective {stage.objective!r} (its settings: {known})"
        )
    return {name: convert_value(declared[name][0], value, f"{key}.loss.{name}") for name, value in stage.loss.items()}


def _at_least(key: str, value: float | None, low: float, none_means: str | None = None) -> None:
    if value is None and none_means:
        return
    if value < low:
        unset = f" (leave it out or null for {none_means})" if none_means else ""
        raise ConfigError(f"{key} must be >= {low}, got {value}{unset}")


def _check_dev_resources(resources: dict[str, float]) -> None:
    """CPUs (at least a share of one: the scorer's threads) and optionally a GPU or a share of one."""
    unknown = sorted(set(resources) - {"CPU", "GPU"})
    if unknown:
        raise ConfigError(f"evaluation.dev_resources: {unknown[0]!r} is not CPU or GPU")
    _greater("evaluation.dev_resources.CPU", resources.get("CPU", 0.0), 0)
    gpus = resources.get("GPU", 0.0)
    if not (gpus >= 0 and (gpus <= 1 or float(gpus).is_integer())):
        raise ConfigError(f"evaluation.dev_resources.GPU: a share of one GPU or a whole number, got {gpus}")


def _greater(key: str, value: float, low: float) -> None:
    if not value > low:
        raise ConfigError(f"{key} must be > {low}, got {value}")


def _matryoshka(key: str, dims: list[int] | None, weights: list[float] | None) -> None:
    """Sizes and weights as far as they can be checked without the model (the run checks the model's size)."""
    if dims is None:
        if weights is not None:
            raise ConfigError(f"{key}.matryoshka_weights needs {key}.matryoshka_dims")
        return
    if not dims or min(dims) < 1 or len(set(dims)) != len(dims):
        raise ConfigError(f"{key}.matryoshka_dims: expected distinct positive sizes, got {dims}")
    if weights is not None and len(weights) != len(dims):
        raise ConfigError(f"{key}.matryoshka_weights: one weight per size in {dims}, got {weights}")
