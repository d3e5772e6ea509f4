"""Encode throughput: this project's ``SentenceEncoder.encode`` beside sentence-transformers' ``encode``.

Every variant encodes the same sentences with the same model in one process, repeats interleaved
(A B C A B C ...) so that a change in machine load hits all of them alike; each record holds the median and the
spread. Variants: ours in fp32, in bf16 under autocast and with bf16 weights, each with smart batching on and off
(the paper's Table 7), and sentence-transformers in fp32 and bf16 (its weights cast; it sorts by characters),
for every batch size; on CPU also sentence-transformers' ONNX backend in fp32 and its dynamically quantised int8
export, where its optional packages (optimum-onnx, onnxruntime) install beside this project's transformers (a row
that cannot run is a record with ``skipped``, the reason). Besides speed: STSb test Spearman per precision (the
first ``limit`` test pairs of a run limited to its first ``limit`` sentences), and utilisation, the model FLOP/s
achieved over the batches as padded against a matmul peak measured on the same device and precision.
"""

from __future__ import annotations

import copy
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from sbert_ray.bench.flops import ForwardFlops, matmul_peak, synchronize
from sbert_ray.bench.tables import label
from sbert_ray.config import ConfigError, check_device_here
from sbert_ray.data.readers import load_records
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.models import SentenceEncoder, build_random_bert, resolve_model_ref
from sbert_ray.models.encoder import PRECISIONS, half_dtype

OURS, REFERENCE = "sbert-ray", "sentence-transformers"


@dataclass
class Variant:
    """One way of encoding: who, in which precision and how (``cast``: none, autocast or weights)."""

    impl: str
    precision: str
    cast: str
    smart_batching: bool
    batch_size: int
    encode: Callable[[Sequence[str], int], object] = field(repr=False)  # (sentences, batch_size) -> embeddings
    # The module that takes each padded batch as a features dict (ours, or sentence-transformers' Transformer
    # module, which calls its Hugging Face model's forward directly, past any hook).
    model: nn.Module = field(repr=False)
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    batch_shapes: list[tuple[int, int]] = field(default_factory=list)

    @property
    def way(self) -> tuple[str, str, str]:
        """What decides the numbers computed (not the speed): implementation, precision, cast."""
        return self.impl, self.precision, self.cast

    @property
    def label(self) -> str:
        return label(vars(self))  # the same fields a record has

    def timed_run(self, sentences: Sequence[str], device: torch.device, record_shapes: bool) -> None:
        hook = self.model.register_forward_pre_hook(self._record_shape, with_kwargs=True) if record_shapes else None
        try:
            synchronize(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            self.encode(sentences, self.batch_size)
            synchronize(device)
            self.seconds.append(time.perf_counter() - start)
            self.cpu_seconds.append(time.process_time() - cpu_start)
        finally:
            if hook is not None:
                hook.remove()

    def _record_shape(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        features = args[0] if args else kwargs["features"]
        self.batch_shapes.append(tuple(features["input_ids"].shape))


class _Encodes:
    """The ``encode(sentences, batch_size, convert_to)`` the evaluators call, for one variant."""

    def __init__(self, encode: Callable[[Sequence[str], int], object]):
        self._encode = encode

    def encode(self, sentences: Sequence[str], batch_size: int = 32, convert_to: str = "numpy"):
        return self._encode(sentences, batch_size)


def stsb_sentences(data_dir=None, limit: int | None = None) -> list[str]:
    """The unique sentences of STSb train, dev and test (15,487), in order of first appearance."""
    pairs = [p for split in ("train", "dev", "test") for p in load_records("stsb", split, data_dir)]
    sentences = list(dict.fromkeys(s for p in pairs for s in (p.sentence1, p.sentence2)))
    return sentences[:limit] if limit else sentences


def model_folder(ref: str, workdir: Path) -> str:
    """A folder (or Hub id) both libraries load: ``random:<shape>`` is built and saved into ``workdir`` first."""
    if ref.startswith("random:"):
        return str(build_random_bert(workdir / ref.replace(":", "-"), shape=ref.removeprefix("random:")))
    return resolve_model_ref(ref)


def build_variants(
    folder: str,
    device: torch.device,
    batch_sizes: Sequence[int],
    precisions: Sequence[str],
    smart_batching: Sequence[bool],
    reference: bool,
    workdir: Path | None = None,
) -> tuple[list[Variant], dict[tuple[str, str, str], str]]:
    """The variants to time, and the ways that cannot run here, each with the reason."""
    ours = SentenceEncoder.load(folder).to(device)
    ours_half = copy.deepcopy(ours).to_precision("bf16") if "bf16" in precisions else None
    ways: list[tuple[str, str, str, bool, Callable, nn.Module]] = []
    for smart in smart_batching:
        if "fp32" in precisions:
            ways.append((OURS, "fp32", "none", smart, _ours(ours, "fp32", smart), ours))
        if ours_half is not None:
            ways.append((OURS, "bf16", "autocast", smart, _ours(ours, "bf16", smart), ours))
            ways.append((OURS, "bf16", "weights", smart, _ours(ours_half, "bf16", smart), ours_half))
    if reference:
        from sentence_transformers import SentenceTransformer

        theirs = SentenceTransformer(folder, device=str(device), trust_remote_code=False)
        if "fp32" in precisions:
            ways.append((REFERENCE, "fp32", "none", True, _theirs(theirs), theirs[0]))
        if "bf16" in precisions:
            theirs_half = copy.deepcopy(theirs).to(half_dtype(device))
            ways.append((REFERENCE, "bf16", "weights", True, _theirs(theirs_half), theirs_half[0]))
    skipped: dict[tuple[str, str, str], str] = {}
    if reference and "fp32" in precisions:
        onnx_ways, reason = _onnx_ways(folder, device, workdir)
        ways.extend(onnx_ways)
        skipped.update({(REFERENCE, "fp32", cast): reason for cast in ONNX_CASTS if reason})
    variants = [
        Variant(impl, precision, cast, smart, batch_size, encode, model)
        for batch_size in batch_sizes
        for impl, precision, cast, smart, encode, model in ways
    ]
    return variants, skipped


ONNX_CASTS = ("onnx", "onnx-int8")  # sentence-transformers' ONNX backend: its export, and that export quantised


def _onnx_ways(folder: str, device: torch.device, workdir: Path | None) -> tuple[list[tuple], str | None]:
    """sentence-transformers' ONNX backend (fp32) and its dynamically quantised int8 export, on CPU; or the reason
    they cannot run here."""
    if device.type != "cpu":
        return [], f"the ONNX rows run on CPU only (onnxruntime's CPU provider), not on {device}"
    try:
        import onnxruntime  # noqa: F401  (sentence-transformers says only "requires installing" when missing)
        import optimum.onnxruntime  # noqa: F401
    except ImportError as err:  # missing, or (optimum-onnx <= 0.1.0) built for transformers < 4.58
        return [], f"sentence-transformers' ONNX backend needs optimum-onnx and onnxruntime: {err}"
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    # The export writes onnx/ into the model's folder: a copy, never the original.
    copy_dir = Path(shutil.copytree(folder, Path(workdir or tempfile.mkdtemp()) / "onnx-model"))
    onnx = SentenceTransformer(str(copy_dir), backend="onnx", device="cpu", trust_remote_code=False)
    config = _quantization_config()
    export_dynamic_quantized_onnx_model(onnx, config, str(copy_dir))
    kwargs = {"file_name": f"onnx/model_qint8_{config}.onnx"}
    int8 = SentenceTransformer(
        str(copy_dir), backend="onnx", device="cpu", model_kwargs=kwargs, trust_remote_code=False
    )
    return [
        (REFERENCE, "fp32", "onnx", True, _theirs(onnx), onnx[0]),
        (REFERENCE, "fp32", "onnx-int8", True, _theirs(int8), int8[0]),
    ], None


def _quantization_config() -> str:
    """onnxruntime's quantisation preset for this CPU: VNNI int8 dot products where the CPU has them."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_vnni" if "avx512_vnni" in flags else "avx2"


def _ours(encoder: SentenceEncoder, precision: str, smart: bool) -> Callable:
    return lambda sentences, batch_size: encoder.encode(
        sentences, batch_size=batch_size, precision=precision, smart_batching=smart
    )


def _theirs(model) -> Callable:
    return lambda sentences, batch_size: model.encode(
        list(sentences), batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True
    )


def run_encode_bench(
    model: str,
    data_dir=None,
    batch_sizes: Sequence[int] = (32,),
    precisions: Sequence[str] = PRECISIONS,
    smart_batching: Sequence[bool] = (True, False),
    repeats: int = 3,
    device: str = "cpu",
    limit: int | None = None,
    reference: bool = True,
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict]:
    """Time every variant ``repeats`` times, interleaved; one record per variant (see the module docstring)."""
    if not precisions or set(precisions) - set(PRECISIONS):
        raise ConfigError(f"precisions must be some of {PRECISIONS}, got {list(precisions)}")
    if repeats < 1 or (limit is not None and limit < 1) or not batch_sizes or min(batch_sizes) < 1:
        raise ConfigError(f"repeats, limit and batch sizes must be at least 1: {repeats}, {limit}, {list(batch_sizes)}")
    check_device_here(device)
    torch_device = torch.device(device)
    sentences = stsb_sentences(data_dir, limit)
    test_pairs = load_records("stsb", "test", data_dir)[:limit]  # a short run is scored short too
    with tempfile.TemporaryDirectory(prefix="sbert-ray-bench-") as workdir:
        folder = model_folder(model, Path(workdir))
        variants, skipped = build_variants(
            folder, torch_device, batch_sizes, precisions, smart_batching, reference, Path(workdir)
        )
        for (impl, precision, cast), reason in skipped.items():
            progress(f"skipped {impl}/{precision}-{cast}: {reason}")
        progress(f"{len(variants)} variants x {repeats} repeats on {len(sentences)} sentences, {device}")
        for variant in variants:  # warm-up: first calls create kernels and allocator pools
            variant.encode(sentences[: 4 * variant.batch_size], variant.batch_size)
        peaks: dict[str, float] = {}
        for repeat in range(repeats):
            for precision in precisions:  # the best of every repeat: the ceiling, whatever the load did meanwhile
                peaks[precision] = max(peaks.get(precision, 0.0), matmul_peak(torch_device, _dtype(precision, device)))
            for variant in variants:
                variant.timed_run(sentences, torch_device, record_shapes=repeat == 0)
                progress(f"repeat {repeat + 1}/{repeats} {variant.label}: {len(sentences) / variant.seconds[-1]:.0f}/s")
        spearman: dict[tuple[str, str, str], float] = {}
        for variant in variants:  # each way of computing once, at the first batch size: quality is not timed
            if variant.way not in spearman:
                scores = evaluate_pairs(_Encodes(variant.encode), test_pairs, batch_size=variant.batch_size)
                spearman[variant.way] = scores["spearman_cosine"]
        ours = SentenceEncoder.load(folder)
        flops, tokens = ForwardFlops(ours.transformer), sum(len(ids) for ids in ours.token_ids(sentences)["input_ids"])
        records = [_record(v, len(sentences), tokens, peaks, spearman, flops, torch_device) for v in variants]
    _add_ratios(records)
    records += [
        {"impl": impl, "precision": precision, "cast": cast, "smart_batching": True, "batch_size": size, "skipped": why}
        for (impl, precision, cast), why in skipped.items()
        for size in batch_sizes
    ]
    for record in records:
        record["model"] = model
        record["spearman_pairs"] = len(test_pairs)
    return records


def _dtype(precision: str, device: torch.device | str) -> torch.dtype:
    return torch.float32 if precision == "fp32" else half_dtype(torch.device(device))


def _record(
    variant: Variant,
    n_sentences: int,
    tokens: int,
    peaks: dict[str, float],
    spearman: dict[tuple[str, str, str], float],
    forward_flops: ForwardFlops,
    device: torch.device,
) -> dict:
    rates = [n_sentences / s for s in variant.seconds]
    median_s = statistics.median(variant.seconds)
    flops = forward_flops(variant.batch_shapes)
    achieved = flops / median_s
    padded = sum(b * s for b, s in variant.batch_shapes)
    fp32_spearman = spearman.get((variant.impl, "fp32", "none"))
    return {
        "impl": variant.impl,
        "precision": variant.precision,
        "cast": variant.cast,
        "dtype": str(_dtype(variant.precision, device)).removeprefix("torch."),
        "smart_batching": variant.smart_batching,
        "batch_size": variant.batch_size,
        "workers": 1,
        "threads_per_worker": torch.get_num_threads(),
        "device": str(device),
        "sentences": n_sentences,
        "repeats": len(variant.seconds),
        "sentences_per_s": n_sentences / median_s,
        "sentences_per_s_min": min(rates),
        "sentences_per_s_max": max(rates),
        "spread": (max(rates) - min(rates)) * median_s / n_sentences,
        "seconds": variant.seconds,
        "sentences_per_cpu_s": n_sentences / statistics.median(variant.cpu_seconds),
        "cpu_seconds": variant.cpu_seconds,
        "tokens": tokens,
        "padded_tokens": padded,
        "padding_share": 1 - tokens / padded,
        "model_gflop": flops / 1e9,
        "achieved_gflops": achieved / 1e9,
        "matmul_peak_gflops": peaks[variant.precision] / 1e9,
        "utilisation": achieved / peaks[variant.precision],
        "spearman": spearman[variant.way],
        "spearman_delta_vs_fp32": spearman[variant.way] - fp32_spearman if fp32_spearman is not None else None,
    }


def _add_ratios(records: list[dict]) -> None:
    """``speedup_vs_reference_fp32`` (over sentence-transformers fp32 at the same batch size),
    ``speedup_vs_fastest_reference`` (over the fastest sentence-transformers variant at the same batch size: torch,
    ONNX or ONNX int8) and, on sorted runs, ``smart_batching_speedup`` (over the same variant unsorted: the paper's
    Table 7), by wall time and by CPU time (``_cpu``); None where not measured.

    CPU time is the work the process did (all its threads). With one thread it is what other processes on a
    shared machine cannot distort, beyond cache and memory contention; with more it includes threads waiting on
    each other, and on a GPU it counts only the host's share.
    """
    by_key = {(r["impl"], r["precision"], r["cast"], r["smart_batching"], r["batch_size"]): r for r in records}
    fastest = {}
    for r in records:
        if r["impl"] == REFERENCE and r["sentences_per_s"] > fastest.get(r["batch_size"], 0.0):
            fastest[r["batch_size"]] = r["sentences_per_s"]
    for r in records:
        best = fastest.get(r["batch_size"])
        r["speedup_vs_fastest_reference"] = r["sentences_per_s"] / best if best else None
        reference = by_key.get((REFERENCE, "fp32", "none", True, r["batch_size"]))
        unsorted = by_key.get((r["impl"], r["precision"], r["cast"], False, r["batch_size"]))
        unsorted = unsorted if r["smart_batching"] else None
        for suffix, rate in (("", "sentences_per_s"), ("_cpu", "sentences_per_cpu_s")):
            r[f"speedup_vs_reference_fp32{suffix}"] = r[rate] / reference[rate] if reference else None
            r[f"smart_batching_speedup{suffix}"] = r[rate] / unsorted[rate] if unsorted else None
