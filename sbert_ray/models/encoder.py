"""SentenceEncoder: a Hugging Face transformer plus pooling, the SBERT network (paper section 3)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal, get_args

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from sbert_ray.models.attention import ATTENTION_IMPLEMENTATIONS
from sbert_ray.models.padded_widths import width_buckets
from sbert_ray.models.pooling import Pooling, PoolingMode
from sbert_ray.models.prompts import check_prompts, resolve_prompt
from sbert_ray.models.resolve import ModelFiles, resolve_model_ref
from sbert_ray.models.st_layout import ModelError, StLayout, write_st_layout
from sbert_ray.progress import progress_bar

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MAX_SEQ_LENGTH = 128
MIN_BATCHES = 8  # encode's default token budget cuts an input into at least this many batches, for threads to share
COMPILED_BATCH_SIZES = 4  # row counts a compiled forward meets: the micro-batch, a pass's last, mini-batches, rest
Precision = Literal["fp32", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


class SentenceEncoder(nn.Module):
    """Maps sentences to fixed-size vectors: transformer -> pooling -> optional L2 normalisation.

    With `truncate_dim`, `encode` returns the first truncate_dim values of each embedding (after normalisation,
    as sentence-transformers truncates); `forward`, what training sees, stays full size. `prompts` and
    `default_prompt_name`: named texts put before the inputs (``sbert_ray.models.prompts``).
    """

    joins_pairs: ClassVar[bool] = False  # each text embedded alone (a reranker's ``CrossEncoderModel`` reads pairs)

    def __init__(
        self,
        transformer: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        pooling: PoolingMode = "mean",
        max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH,
        normalize: bool = False,
        truncate_dim: int | None = None,
        prompts: Mapping[str, str] | None = None,
        default_prompt_name: str | None = None,
        include_prompt: bool = True,
    ) -> None:
        super().__init__()
        problem = check_prompts(prompts or {}, default_prompt_name)
        if problem:
            raise ValueError(problem)
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.pooling = Pooling(pooling, include_prompt)
        self.prompts, self.default_prompt_name = dict(prompts or {}), default_prompt_name
        self.max_seq_length = max_seq_length
        self.normalize = normalize
        self.truncate_dim = truncate_dim
        self._compiled_forward = None  # the transformer's forward compiled for training (compile_for_training)
        # A decoder (Qwen, Llama, Mistral) attends causally, as its attention layers say: it keeps the 2-D mask.
        self.causal = any(getattr(module, "is_causal", False) is True for module in transformer.modules())
        # BERT-style models carry a [CLS] pooler head that sentence pooling never uses. Frozen, it is still
        # saved (so reloading warns about nothing) but DDP does not wait for gradients it never gets.
        pooler = getattr(transformer, "pooler", None)
        if isinstance(pooler, nn.Module):
            pooler.requires_grad_(False)

    @classmethod
    def load(
        cls,
        ref: str | os.PathLike[str],
        pooling: PoolingMode | None = None,
        max_seq_length: int | None = None,
        normalize: bool | None = None,
        allow_unsafe_weights: bool = False,
        truncate_dim: int | None = None,
        prompts: Mapping[str, str] | None = None,
        default_prompt_name: str | None = None,
        attn_implementation: str = "sdpa",
    ) -> SentenceEncoder:
        """Load a sentence-transformers folder, a plain Hugging Face model (mean pooling) or a Hub id, with
        transformers' ``attn_implementation`` (``check_attention``).

        Arguments that are not None override what the saved model says (``prompts`` replace the saved prompts and
        their default). Like `from_pretrained`, the result is in eval mode; call `.train()` before training. Weights
        load from safetensors files only, unless ``allow_unsafe_weights`` (pickled PyTorch files can run code); the
        model's own code never runs.
        """
        from transformers import AutoConfig, AutoModel  # here: importing the package must not load model code

        files = ModelFiles.read(resolve_model_ref(ref))
        files.check_weights(allow_pickle=allow_unsafe_weights)
        config = AutoConfig.from_pretrained(files.path, subfolder=files.subfolder, trust_remote_code=False)
        transformer = load_pretrained(AutoModel, files, config, allow_unsafe_weights, attn_implementation, str(ref))
        tokenizer, layout = files.tokenizer(), files.layout
        if max_seq_length is None:
            max_seq_length = _saved_max_seq_length(layout, tokenizer, transformer)
        problem = max_seq_length_problem(max_seq_length, tokenizer, transformer.config, str(ref))
        if problem:
            raise ModelError(f"max_seq_length {problem}")
        truncate_dim, size = truncate_dim or (layout.truncate_dim if layout else None), transformer.config.hidden_size
        if truncate_dim is not None and truncate_dim > size:
            raise ModelError(f"{ref}: truncate_dim {truncate_dim} is beyond the model's {size} dimensions")
        if prompts is None:  # the saved prompts, and their default unless one is given; given prompts replace both
            prompts = layout.prompts if layout else {}
            default_prompt_name = default_prompt_name or (layout.default_prompt_name if layout else None)
        problem = check_prompts(prompts or {}, default_prompt_name)
        if problem:
            raise ModelError(f"{ref}: {problem}")
        encoder = cls(
            transformer,
            tokenizer,
            pooling=pooling or (layout.pooling if layout else "mean"),
            max_seq_length=max_seq_length,
            normalize=normalize if normalize is not None else bool(layout and layout.normalize),
            truncate_dim=truncate_dim,
            prompts=prompts,
            default_prompt_name=default_prompt_name,
            include_prompt=layout.include_prompt if layout else True,
        )
        return encoder.eval()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save in the sentence-transformers layout (loadable by `sentence_transformers.SentenceTransformer`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if _is_lora(self.transformer):
            from sbert_ray.models.lora import save_merged  # peft is loaded: it made this transformer

            save_merged(self.transformer, path)
        else:
            self.transformer.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        write_st_layout(
            path,
            StLayout(
                transformer_subfolder="",
                pooling=self.pooling.mode,
                normalize=self.normalize,
                max_seq_length=self.max_seq_length,
                truncate_dim=self.truncate_dim,
                prompts=self.prompts,
                default_prompt_name=self.default_prompt_name,
                include_prompt=self.pooling.include_prompt,
            ),
            self.embedding_dim,
        )

    @property
    def embedding_dim(self) -> int:
        """The full size of the embeddings `forward` computes."""
        return self.transformer.config.hidden_size

    @property
    def truncate_dim(self) -> int | None:
        return self._truncate_dim

    @truncate_dim.setter
    def truncate_dim(self, dim: int | None) -> None:
        if dim is not None and not 0 < dim <= self.embedding_dim:
            raise ValueError(f"truncate_dim must be in 1..{self.embedding_dim} (the model's size), got {dim}")
        self._truncate_dim = dim

    @property
    def output_dim(self) -> int:
        """The size of the embeddings `encode` returns."""
        return self.truncate_dim or self.embedding_dim

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def precision(self) -> Precision:
        """``"fp32"``, or ``"bf16"`` for 16-bit weights (bfloat16, or float16 on GPUs without bfloat16)."""
        return "fp32" if self.dtype == torch.float32 else "bf16"

    def to_precision(self, precision: Precision) -> SentenceEncoder:
        """Cast the weights in place for inference: ``"bf16"`` to ``half_dtype(self.device)`` (so move the
        encoder to its device first), ``"fp32"`` back to float32 (bf16-rounded values stay rounded).
        Training keeps fp32 weights and uses autocast instead."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        return self.to(dtype=torch.float32 if precision == "fp32" else half_dtype(self.device))

    def tokenize(self, sentences: Sequence[str]) -> dict[str, Tensor]:
        """Token ids for one batch, padded to its longest sentence and truncated to max_seq_length."""
        batch = self.tokenizer(
            list(sentences),
            padding=True,
            truncation=True,
            max_length=self.max_seq_length,
            return_tensors="pt",
        )
        return dict(batch)

    def forward(self, features: dict[str, Tensor], padded: bool = True) -> Tensor:
        """Sentence embeddings [batch, embedding_dim] for tokenized features (on this module's device).
        ``padded=False``, which the caller knows from the host (``models.padded_widths.unpadded``), says no token is
        padding: the transformer then gets no attention mask, as transformers itself drops an all-ones one, so SDPA
        may pick its flash kernel (which takes no mask) on a GPU; pooling still reads the mask."""
        inputs = {name: features[name] for name in self.tokenizer.model_input_names if name in features}
        if "attention_mask" in inputs and not padded:
            del inputs["attention_mask"]
        elif "attention_mask" in inputs:
            inputs["attention_mask"] = self._attention_mask(inputs["attention_mask"])
        # Pooled in at least float32 whatever the model computed in: a bf16 sum over many tokens loses digits (a
        # float64 model stays float64: tests compare gradients in it).
        transformer = self._compiled_forward if (self.training and self.compiled) else self.transformer
        hidden = transformer(**inputs).last_hidden_state
        token_embeddings = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        embeddings = self.pooling(token_embeddings, features["attention_mask"], _prompt_length(features))
        return F.normalize(embeddings, p=2, dim=1) if self.normalize else embeddings

    def prompt_length(self, prompt: str) -> int:
        """The tokens a prompt takes at the start of an input, as sentence-transformers counts them for
        ``features["prompt_length"]``: the prompt tokenised alone, with the leading special token ([CLS]) and
        without a trailing one ([SEP]); 0 for no prompt."""
        if not prompt:
            return 0
        ids = self.tokenizer(prompt, truncation=True, max_length=self.max_seq_length)["input_ids"]
        return len(ids) - (ids[-1] in self.tokenizer.all_special_ids)

    def resolve_prompt(self, prompt: str | None = None, prompt_name: str | None = None) -> str:
        """The prompt text ``encode`` puts before each sentence ('' for none); see ``models.prompts``."""
        return resolve_prompt(self.prompts, self.default_prompt_name, prompt, prompt_name)

    @property
    def compiled(self) -> bool:
        """Whether training-mode forwards run compiled (``compile_for_training``)."""
        return self._compiled_forward is not None

    def compile_for_training(self) -> None:
        """Compile the transformer's forward (``torch.compile``, inductor) for training-mode forwards; evaluation
        keeps the eager model, whose batches come in any width. Static shapes (``dynamic=False``): a GPU's training
        batches are padded to a few bucketed widths (``models.padded_widths``), at a few batch sizes (the
        micro-batch, cached MNRL's mini-batches and their remainders), with or without an attention mask, so a run
        compiles a bounded number of graphs, each specialised to its shape (the kernels a dynamic graph would share
        are tuned for none); dynamo's recompile limit is raised to that bound. The weights stay the module's own:
        checkpoints and ``state_dict`` are unchanged."""
        import torch._dynamo  # here: only a compiling run pays for importing dynamo

        dynamo = torch._dynamo.config
        graphs = len(width_buckets(self.max_seq_length)) * COMPILED_BATCH_SIZES * 2  # 2: with and without a mask
        dynamo.recompile_limit = max(dynamo.recompile_limit, graphs)
        self._compiled_forward = torch.compile(self.transformer.forward, dynamic=False)

    def _attention_mask(self, padding: Tensor) -> Tensor:
        """The mask the transformer gets: for SDPA in a model that builds its masks with transformers' masking
        utilities, already 4-D (batch, 1, 1, tokens; True attends), which transformers passes through as it is.
        Given the 2-D one it first asks whether any token is padding (``padding_mask.all()`` in
        ``masking_utils``), a device-to-host sync in every forward, only to drop the mask when none is. The
        4-D mask broadcasts to the one it would build, so the arithmetic is the same. Other attention
        implementations (eager adds a float mask), models with their own mask code and causal models (decoders:
        a 4-D mask is taken as the whole mask, so their causal part would be lost) keep the 2-D mask."""
        transformer = self.transformer
        sdpa = transformer.config._attn_implementation == "sdpa" and transformer.is_backend_compatible()
        if sdpa and not self.causal:
            return padding.bool()[:, None, None, :]
        return padding

    def token_ids(self, sentences: Sequence[str]) -> dict[str, list[list[int]]]:
        """Unpadded ids per sentence, truncated to max_seq_length (see ``token_ids``)."""
        return token_ids(self.tokenizer, sentences, self.max_seq_length)

    def encode(
        self,
        sentences: Sequence[str],
        batch_size: int = 32,
        convert_to: Literal["numpy", "torch"] = "numpy",
        precision: Precision | None = None,
        smart_batching: bool = True,
        prompt_name: str | None = None,
        prompt: str | None = None,
        max_tokens: int | None = None,
        threads: int | None = None,
    ) -> np.ndarray | Tensor:
        """Float32 embeddings [len(sentences), output_dim] in the caller's order, computed without autograd.

        Smart batching (paper Table 7): sentences are sorted by token count, longest first, so each batch
        pads only to its own longest member. Token count rather than character count (as
        sentence-transformers uses) because tokens are what padding costs; the ids are reused for the batches.
        Batches are cut by a token budget (``smart_batches``): at most ``max_tokens`` padded tokens each, by default
        ``batch_size * max_seq_length``, so a batch holds ``batch_size`` sentences of the full length and more of
        shorter ones (a short batch leaves a CPU's matrix units, and a GPU, mostly idle); less for a small input,
        which is cut into at least MIN_BATCHES batches for threads to share (``token_budget``). ``smart_batching=False``
        keeps the input order in batches of ``batch_size`` (for measuring what sorting saves).

        ``precision``: ``"fp32"`` or ``"bf16"``; by default the weights' own (``to_precision``). ``"bf16"`` on
        float32 weights runs under autocast; on 16-bit weights it runs natively, which is faster. bf16 means
        bfloat16 on CPUs and on GPUs that support it, float16 on older GPUs (see ``half_dtype``).
        A torch result stays on the module's device.

        ``prompt_name`` (one of ``prompts``) or ``prompt`` (a text) is put before every sentence; with neither,
        the default prompt, if the model has one (as sentence-transformers' ``encode``).

        ``threads`` (CPU only): whole batches are encoded this many at a time, each by its own Python thread running
        torch on one intra-op thread (torch's operations release the GIL). A small model's operations are too short
        to split well over intra-op threads: torch splits each one evenly and waits for the slowest part, at every
        operation, while whole batches per thread never wait on each other. By default ``torch.get_num_threads()``
        (the cores the process was given: 1 in a one-CPU Ray actor, which then runs batches one by one, as ``1``
        does). Each batch's vectors do not depend on the thread that runs it: the result is deterministic, bit for
        bit what ``threads=1`` computes on one intra-op thread (on several, torch may sum in another order: float
        rounding in the last bits). Ignored on GPUs.
        """
        if isinstance(sentences, str):
            raise TypeError("encode expects a sequence of sentences, not a single string")
        prompt = self.resolve_prompt(prompt, prompt_name)
        ids = self.token_ids([prompt + sentence for sentence in sentences])
        return self.encode_token_ids(
            ids, batch_size, convert_to, precision, smart_batching, max_tokens, self.prompt_length(prompt), threads
        )

    def encode_token_ids(
        self,
        ids: dict[str, list[list[int]]],
        batch_size: int = 32,
        convert_to: Literal["numpy", "torch"] = "numpy",
        precision: Precision | None = None,
        smart_batching: bool = True,
        max_tokens: int | None = None,
        prompt_length: int = 0,
        threads: int | None = None,
    ) -> np.ndarray | Tensor:
        """``encode`` of sentences already tokenised by ``token_ids`` (a pipeline's CPU stage does that, so the
        replicas on GPUs only run the model); ``prompt_length``: the tokens of a prompt the ids start with."""
        if convert_to not in ("numpy", "torch"):
            raise ValueError(f"convert_to must be 'numpy' or 'torch', not {convert_to!r}")
        if batch_size < 1:  # range(0, n, -1) is empty: the result would be uninitialised memory
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        precision = precision or self.precision
        self._precision_context(precision)  # a bad precision fails here, before any work
        threads = self._batch_threads(threads)
        lengths = [len(row) for row in ids["input_ids"]]
        if smart_batching:
            batches = smart_batches(lengths, batch_size, max_tokens or self.token_budget(batch_size, lengths))
        else:
            batches = input_order_batches(len(lengths), batch_size)
        embeddings = torch.empty(len(lengths), self.output_dim, device=self.device)
        if lengths:
            was_training = self.training
            self.eval()
            try:
                with _batch_map(threads) as batch_map:
                    self._encode_batches(ids, lengths, batches, prompt_length, precision, batch_map, out=embeddings)
            finally:
                self.train(was_training)
        return embeddings.cpu().numpy() if convert_to == "numpy" else embeddings

    def _encode_batches(
        self,
        ids: dict[str, list[list[int]]],
        lengths: list[int],
        batches: list[list[int]],
        prompt_length: int,
        precision: Precision,
        batch_map: Callable,
        out: Tensor,
    ) -> None:
        def forward(batch: list[int]) -> Tensor:
            features = self._padded(ids, batch, [lengths[i] for i in batch]) | {"prompt_length": prompt_length}
            # Entered by the thread that runs the batch: grad mode and autocast are per thread.
            with torch.inference_mode(), self._precision_context(precision):
                return self(features)[:, : self.output_dim]

        # Rows are written in batch order, then put back in the caller's order with one scatter.
        order = [i for batch in batches for i in batch]
        in_batch_order = torch.empty_like(out)
        start = 0
        for rows in progress_bar(batch_map(forward, batches), total=len(batches), desc="encode", unit="batch"):
            in_batch_order[start : start + len(rows)] = rows
            start += len(rows)
        out[torch.tensor(order, device=out.device)] = in_batch_order

    def token_budget(self, batch_size: int, lengths: Sequence[int]) -> int:
        """``encode``'s default ``max_tokens`` for sentences of ``lengths`` tokens: ``batch_size`` sentences of the
        full length, but no more than cuts the input into MIN_BATCHES batches (and at least one full-length
        sentence), so that a small input gives every thread a few batches rather than one thread one batch. It
        depends on the input alone, not on the threads: the same sentences make the same batches, and so the same
        vectors, however many threads (or Ray workers given these batches) encode them."""
        return min(batch_size * self.max_seq_length, max(self.max_seq_length, sum(lengths) // MIN_BATCHES))

    def _batch_threads(self, threads: int | None) -> int:
        """The Python threads ``encode`` runs batches on: 1 on a GPU (one stream runs them in turn anyway)."""
        if self.device.type != "cpu":
            return 1
        return threads or torch.get_num_threads()

    def _padded(self, ids: dict[str, list[list[int]]], batch: list[int], lengths: list[int]) -> dict[str, Tensor]:
        """One batch padded with numpy (a vectorised scatter; ``tokenizer.pad`` on Python lists is far slower),
        copied to the device from pinned memory without blocking on a GPU."""
        width = max(lengths)
        columns = np.arange(width)
        counts = np.asarray(lengths)[:, None]
        mask = columns >= width - counts if self.tokenizer.padding_side == "left" else columns < counts
        arrays = {"attention_mask": mask.astype(np.int64)}
        # Padded positions are masked out, so any valid id does where a tokenizer has no pad token.
        pad_values = {"input_ids": self.tokenizer.pad_token_id or 0, "token_type_ids": self.tokenizer.pad_token_type_id}
        for name, rows in ids.items():
            array = np.full(mask.shape, pad_values[name], dtype=np.int64)
            array[mask] = np.fromiter(itertools.chain.from_iterable(rows[i] for i in batch), np.int64, mask.sum())
            arrays[name] = array
        tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
        if self.device.type == "cuda":
            tensors = {name: tensor.pin_memory() for name, tensor in tensors.items()}
        return {name: tensor.to(self.device, non_blocking=True) for name, tensor in tensors.items()}

    def _precision_context(self, precision: Precision) -> contextlib.AbstractContextManager:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        if precision == "fp32" and self.precision != "fp32":
            raise ValueError(f"the weights are {self.dtype}; fp32 encoding needs fp32 weights (to_precision('fp32'))")
        if precision == "bf16" and self.precision == "fp32":
            return torch.autocast(self.device.type, dtype=half_dtype(self.device))
        return contextlib.nullcontext()


def _is_lora(transformer: nn.Module) -> bool:
    """Whether peft wrapped the transformer with LoRA adapters (``models.lora.apply_lora``); asked without
    importing peft, which only LoRA runs load."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(transformer, peft.PeftModel)


@contextlib.contextmanager
def _batch_map(threads: int) -> Iterator[Callable]:
    """A ``map`` over whole batches, results in order: ``map`` itself for one thread, else ``threads`` Python
    threads, each running torch on one intra-op thread. torch's intra-op thread count is per thread (OpenMP's and
    MKL's settings are), so the caller's own stays as it is; setting it also sets the count a thread starting
    later begins with, which is put back on the way out."""
    if threads == 1:
        yield map
        return
    intra_op = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            yield pool.map
    finally:
        torch.set_num_threads(intra_op)


def _prompt_length(features: dict[str, Tensor]) -> int:
    """``features["prompt_length"]`` as one number: an int, or a tensor holding the batch's count (one value, or
    the same value per row, as training batches carry it); 0 when absent."""
    length = features.get("prompt_length", 0)
    return int(length.reshape(-1)[0]) if isinstance(length, Tensor) else int(length)


def token_ids(tokenizer: PreTrainedTokenizerBase, sentences: Sequence[str], max_length: int) -> dict[str, list]:
    """Unpadded ids per sentence, truncated to ``max_length``: ``input_ids`` and, where the model takes them,
    ``token_type_ids``. No attention mask: padding rebuilds it from the lengths, and asking the tokenizer for
    fewer lists makes it markedly faster (fast tokenizers spend most of their time building Python lists)."""
    if not sentences:  # the tokenizer refuses an empty list
        return {"input_ids": []}
    wants_type_ids = "token_type_ids" in tokenizer.model_input_names
    encodings = tokenizer(
        list(sentences),
        truncation=True,
        max_length=max_length,
        return_attention_mask=False,
        return_token_type_ids=wants_type_ids,
    )
    return {name: encodings[name] for name in ("input_ids", "token_type_ids") if name in encodings}


def smart_batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Indices cut into batches after a stable sort by length, longest first (what ``encode`` does): each batch
    as many sentences as fit in ``max_tokens`` padded tokens (its first, longest member times the count; at least
    one), or ``batch_size`` sentences each when ``max_tokens`` is None."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_tokens is None:
        return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    batches, start = [], 0
    while start < len(order):
        count = max(1, max_tokens // max(1, lengths[order[start]]))
        batches.append(order[start : start + count])
        start += count
    return batches


def input_order_batches(count: int, batch_size: int) -> list[list[int]]:
    return [list(range(start, min(start + batch_size, count))) for start in range(0, count, batch_size)]


def load_pretrained(
    auto_class, files: ModelFiles, config, allow_unsafe_weights: bool, attn_implementation: str, ref: str
) -> PreTrainedModel:
    """``auto_class.from_pretrained`` (AutoModel, or a reranker's AutoModelForSequenceClassification) of ``files``
    with ``config``, as every model here loads: fp32 whatever the checkpoint holds (transformers 5 defaults to
    dtype="auto"; training and published numbers need fp32 weights, 16-bit runs cast or autocast explicitly),
    safetensors weights unless ``allow_unsafe_weights``, never the model's own code."""
    return auto_class.from_pretrained(
        files.path,
        config=config,
        subfolder=files.subfolder,
        dtype=torch.float32,
        use_safetensors=None if allow_unsafe_weights else True,
        trust_remote_code=False,
        attn_implementation=supported_attention(config, check_attention(attn_implementation), ref),
    )


def check_attention(attn_implementation: str) -> str:
    """``attn_implementation`` if transformers can run it here: ``sdpa`` (PyTorch's fused attention, the default),
    ``eager`` (plain matrix products) and ``flash_attention_2``, which needs the flash-attn package and a CUDA GPU
    (a ModelError naming ``model.attn_implementation`` otherwise, rather than transformers' ImportError)."""
    from transformers.utils import is_flash_attn_2_available  # here: importing the package must not load model code

    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ModelError(
            f"model.attn_implementation: {attn_implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS}"
        )
    if attn_implementation == "flash_attention_2" and not is_flash_attn_2_available():
        raise ModelError(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package (>= 2.3.3) and a CUDA GPU, "
            "and this process has not both; use sdpa"
        )
    return attn_implementation


def supported_attention(config, attn_implementation: str, ref: str) -> str:
    """``attn_implementation``, except that a model whose transformers class has no sdpa attention (Gemma 2: its
    logit soft-capping has no fused kernel) runs eager, said in the log, as sentence-transformers loads it."""
    from transformers import MODEL_MAPPING  # here: importing the package must not load model code

    model_class = MODEL_MAPPING.get(type(config), None)
    if attn_implementation == "sdpa" and model_class is not None and not model_class._supports_sdpa:
        log.warning("%s: %s has no sdpa attention in transformers; using eager", ref, model_class.__name__)
        return "eager"
    return attn_implementation


def compiles(setting: bool | Literal["auto"], device: torch.device) -> bool:
    """``scaling.compile``: ``"auto"`` compiles on CUDA only (on CPUs the compilation costs more than it gains)."""
    return device.type == "cuda" if setting == "auto" else setting


def half_dtype(device: torch.device) -> torch.dtype:
    """The 16-bit type ``precision="bf16"`` uses on ``device``: bfloat16 on CPUs and on GPUs that support it
    (Ampere and newer), float16 on older GPUs (V100, T4), which have no bfloat16 arithmetic."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


def _saved_max_seq_length(
    layout: StLayout | None, tokenizer: PreTrainedTokenizerBase, transformer: PreTrainedModel
) -> int:
    """The saved limit: sentence_bert_config.json, else (sentence-transformers >= 6 folders) the tokenizer's
    model_max_length capped by the position embeddings; a plain Hugging Face model gets the paper's 128."""
    if layout is None:
        return DEFAULT_MAX_SEQ_LENGTH
    if layout.max_seq_length is not None:
        return int(layout.max_seq_length)
    limits = [tokenizer.model_max_length, getattr(transformer.config, "max_position_embeddings", None)]
    return int(min(limit for limit in limits if limit is not None))


def max_seq_length_problem(max_seq_length: int, tokenizer: PreTrainedTokenizerBase, config, name: str) -> str | None:
    """Why the model ``name`` cannot take inputs of ``max_seq_length`` tokens, or None. The tokenizer cannot cut
    below its special tokens ([CLS] and [SEP] for BERT: at least 3), where every input would keep its full length
    or become the same empty sentence; above the position embeddings the model fails on a long input."""
    special = tokenizer.num_special_tokens_to_add(pair=False)
    if max_seq_length <= special:
        return (
            f"{max_seq_length} leaves no token for the text: {name!r} adds {special} special tokens to every input; "
            f"use at least {special + 1}"
        )
    limit = position_limit(tokenizer, config)
    if limit is not None and max_seq_length > limit:
        return f"{max_seq_length} is beyond the {limit} positions of {name!r}; use at most {limit}"
    return None


def position_limit(tokenizer: PreTrainedTokenizerBase, config) -> int | None:
    """The longest input the model's position embeddings hold; None when the config has none (relative positions).

    RoBERTa-style models (XLM-R, MPNet, ...) number positions from after the padding index, so their 514
    embeddings hold 512 tokens, which their tokenizer's model_max_length says. A model_max_length further below
    is a saved default (sentence-transformers >= 6 keeps max_seq_length there), not a limit.
    """
    positions = getattr(config, "max_position_embeddings", None)
    if positions is None:
        return None
    tokens = tokenizer.model_max_length
    return tokens if positions - 2 <= tokens < positions else positions
