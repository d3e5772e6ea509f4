"""Encode speed on CPU: this project's best modes beside sentence-transformers' fastest backends (issue 19, item 7).

sentence-transformers' ONNX backend needs optimum-onnx, whose only release (0.1.0) wants transformers < 4.58, while
this project needs transformers 5; so the two sides run in two Python environments, as two long-lived worker
processes this script starts (``--serve peer`` / ``--serve ours``). Each loads its variants and warms them up; then
the driver times one variant at a time, interleaved (peer, ours, peer, ours ...; the order rotated every round), so
that a swing in machine load hits every variant alike, and nothing else of ours computes meanwhile. Each round
gives every one of our variants a ratio to each peer variant timed in the same round; the records hold the
median ratio and its spread (min-max). Quality: STSb test Spearman (cosine, x100) of every variant, computed the
same way on both sides.

Variants: the peer (sentence-transformers 5.x) in torch fp32, ONNX fp32 and its dynamically quantised int8 export
(``export_dynamic_quantized_onnx_model``, the avx512_vnni preset where the CPU has VNNI); ours (``SentenceEncoder
.encode``, smart batching with the token budget) in fp32, bf16 weights and bf16 autocast, as shipped (whole batches
spread over ``--threads`` Python threads of one intra-op thread each, a small input cut into at least 8 batches:
``encode``'s defaults) and as before that (``-serial``: one batch at a time on all intra-op threads, the full token
budget of 32 x 256 tokens). Texts: the unique sentences
of STSb test (2,552; ``--limit`` times the first N), or of train+dev+test (``--sentences all``, 15,487: the ``bench
encode`` set); batch size 32 for both (theirs sorts by characters, ours by tokens and cuts by a token budget).
``--threads``: torch's and onnxruntime's intra-op threads on both sides (default: all CPUs).

Tried and dropped (2026-12-01, this 2-core VM): torch dynamic int8 (``quantize_dynamic`` on every Linear, per
channel, fbgemm or oneDNN) scores STSb test 81.0 against the peer's ONNX int8 81.87 (leaving the FFN input layers
in fp32: 81.74) and was no faster than bf16 weights; token budgets of 1,024 and 8,192 were not faster than 4,096
(one batch at a time). With whole batches over 2 threads (2026-12-02, bf16 weights, 300 sentences, 10 rounds,
load 7-12): a budget of 8,192 tokens (one batch: one thread works) 181/s, 2,048 248/s, 1,024 329/s; hence
``encode`` cuts a small input into at least 8 batches (``SentenceEncoder.token_budget``).

The peer environment (once; its own packages shadow the main venv's, torch comes from there):

    python3.11 -m venv /work/venv-onnx
    echo /work/main/.venv/lib/python3.11/site-packages > /work/venv-onnx/lib/python3.11/site-packages/main_venv.pth
    /work/venv-onnx/bin/pip install sentence-transformers==5.7.0 transformers==4.57.6 \\
        "optimum-onnx[onnxruntime]==0.1.0" onnxruntime==1.32.0 "tokenizers<0.23" datasets==4.1.1

Then, in this project's environment:

    python benchmarks/encode_vs_onnx.py --peer-python /work/venv-onnx/bin/python --data-dir ../shared/data \\
        --limit 300 --rounds 7 --threads 2 --output benchmarks/results/encode_vs_onnx.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
PEER_VARIANTS = ("st-torch-fp32", "st-onnx-fp32", "st-onnx-int8")
OUR_VARIANTS = ("ours-fp32-serial", "ours-bf16-serial", "ours-fp32", "ours-bf16", "ours-bf16-autocast")
PEERS_TO_BEAT = ("st-torch-fp32", "st-onnx-int8")  # the ratios reported: to ST's baseline and to its fastest


# ---------------------------------------------------------------- the workers (one per Python environment)


def sentences_and_pairs(data_dir: str, which: str, limit: int | None = None) -> tuple[list[str], list]:
    from sbert_ray.data.readers import load_records

    splits = ("test",) if which == "test" else ("train", "dev", "test")
    pairs = [p for split in splits for p in load_records("stsb", split, data_dir)]
    sentences = list(dict.fromkeys(s for p in pairs for s in (p.sentence1, p.sentence2)))
    return sentences[:limit], load_records("stsb", "test", data_dir)


def stsb_spearman(encode, pairs) -> float:
    """Spearman x100 of the cosine of each STSb test pair against its gold score (as ``evaluate_pairs``)."""
    from scipy.stats import spearmanr

    def unit(rows):
        rows = np.asarray(rows, dtype=np.float64)
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)

    first, second = unit(encode([p.sentence1 for p in pairs])), unit(encode([p.sentence2 for p in pairs]))
    return 100 * float(spearmanr((first * second).sum(axis=1), [p.score for p in pairs]).statistic)


def peer_variants(folder: str, batch_size: int, threads: int, workdir: Path) -> dict:
    import onnxruntime
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    session_options = onnxruntime.SessionOptions()
    session_options.intra_op_num_threads = threads  # as torch.set_num_threads: the same cores for every variant

    def encode_with(model):
        return lambda texts: model.encode(texts, batch_size=batch_size, show_progress_bar=False)

    copy_dir = Path(shutil.copytree(folder, workdir / "onnx-model"))  # the export writes onnx/ into the folder
    torch_fp32 = SentenceTransformer(folder, device="cpu")
    onnx = SentenceTransformer(
        str(copy_dir), backend="onnx", device="cpu", model_kwargs={"session_options": session_options}
    )
    preset = "avx512_vnni" if "avx512_vnni" in Path("/proc/cpuinfo").read_text() else "avx2"
    export_dynamic_quantized_onnx_model(onnx, preset, str(copy_dir))
    int8 = SentenceTransformer(
        str(copy_dir),
        backend="onnx",
        device="cpu",
        model_kwargs={"file_name": f"onnx/model_qint8_{preset}.onnx", "session_options": session_options},
    )
    return dict(zip(PEER_VARIANTS, map(encode_with, (torch_fp32, onnx, int8)), strict=True))


def our_variants(folder: str, batch_size: int, names: list[str]) -> dict:
    import copy

    from sbert_ray.models import SentenceEncoder

    fp32 = SentenceEncoder.load(folder)
    bf16 = copy.deepcopy(fp32).to_precision("bf16")

    def encode_with(encoder, **options):
        return lambda texts: encoder.encode(texts, batch_size=batch_size, **options)

    variants = {
        "ours-fp32": encode_with(fp32),
        "ours-bf16": encode_with(bf16),
        "ours-bf16-autocast": encode_with(fp32, precision="bf16"),
        # encode before batches went to threads: one at a time on all intra-op threads, the full token budget
        "ours-fp32-serial": encode_with(fp32, threads=1, max_tokens=batch_size * fp32.max_seq_length),
        "ours-bf16-serial": encode_with(bf16, threads=1, max_tokens=batch_size * bf16.max_seq_length),
    }
    return {name: variants[name] for name in names}


def serve(side: str, args: argparse.Namespace) -> None:
    """Answer the driver's commands on stdin, one JSON line each on stdout: ``time NAME``, ``score NAME``."""
    import torch

    torch.set_num_threads(args.threads)
    sentences, pairs = sentences_and_pairs(args.data_dir, args.sentences, args.limit)
    from sbert_ray.models.resolve import resolve_model_ref

    folder = resolve_model_ref(MODEL)
    with tempfile.TemporaryDirectory(prefix="encode-vs-onnx-") as workdir:
        if side == "peer":
            variants = peer_variants(folder, args.batch_size, args.threads, Path(workdir))
        else:
            variants = our_variants(folder, args.batch_size, args.ours)
        for encode in variants.values():  # warm-up: kernels, allocator pools, onnxruntime's arenas
            encode(sentences[: 8 * args.batch_size])
        reply = sys.stdout
        versions = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
        if side == "peer":
            import onnxruntime
            import sentence_transformers

            versions |= {
                "sentence_transformers": sentence_transformers.__version__,
                "onnxruntime": onnxruntime.__version__,
            }
        print(json.dumps({"variants": list(variants), "versions": versions, "threads": torch.get_num_threads()}),
              file=reply, flush=True)  # fmt: skip
        for line in sys.stdin:
            command, name = line.split()
            if command == "time":
                start, cpu_start = time.perf_counter(), time.process_time()
                variants[name](sentences)
                answer = {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start}
            else:
                answer = {"spearman": stsb_spearman(variants[name], pairs)}
            print(json.dumps(answer), file=reply, flush=True)


# ---------------------------------------------------------------- the driver


class Worker:
    def __init__(self, python: str, side: str, args: argparse.Namespace):
        command = [python, __file__, "--serve", side, "--data-dir", args.data_dir, "--sentences", args.sentences]
        command += ["--batch-size", str(args.batch_size), "--threads", str(args.threads), "--ours", ",".join(args.ours)]
        command += ["--limit", str(args.limit)] if args.limit else []
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._answer()

    def ask(self, command: str, name: str) -> dict:
        self.process.stdin.write(f"{command} {name}\n")
        self.process.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"a worker ({self.process.args[3]}) ended early: rc {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def interleaved(peer: list[str], ours: list[str], shift: int) -> list[str]:
    """peer, ours, peer, ours ... (the longer list's rest at the end), rotated by ``shift``."""
    order = [name for pair in zip(peer, ours, strict=False) for name in pair]
    order += peer[len(ours) :] + ours[len(peer) :]
    shift %= len(order)
    return order[shift:] + order[:shift]


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def drive(args: argparse.Namespace) -> dict:
    workers = {"peer": Worker(args.peer_python, "peer", args), "ours": Worker(sys.executable, "ours", args)}
    side_of = {name: side for side, w in workers.items() for name in w.hello["variants"]}
    n_sentences = len(sentences_and_pairs(args.data_dir, args.sentences, args.limit)[0])
    seconds: dict[str, list[float]] = {name: [] for name in side_of}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in side_of}
    loads = []
    try:
        for round_ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in interleaved(workers["peer"].hello["variants"], workers["ours"].hello["variants"], round_):
                answer = workers[side_of[name]].ask("time", name)
                seconds[name].append(answer["seconds"])
                cpu_seconds[name].append(answer["cpu_seconds"])
            line = ", ".join(f"{name} {n_sentences / seconds[name][-1]:.0f}/s" for name in side_of)
            print(f"round {round_ + 1}/{args.rounds} (load {loads[-1]:.1f}): {line}", flush=True)
        score = {name: side for name, side in side_of.items() if args.score}
        spearman = {name: workers[side].ask("score", name)["spearman"] for name, side in score.items()}
    finally:
        for worker in workers.values():
            worker.close()
    records = {}
    for name, side in side_of.items():
        rates = [n_sentences / s for s in seconds[name]]
        records[name] = {
            "side": side,
            "sentences_per_s": summary(rates),
            "sentences_per_cpu_s": statistics.median(n_sentences / s for s in cpu_seconds[name]),
            "seconds": seconds[name],
            "spearman": spearman.get(name),
        }
        if side == "ours":  # the same round's ratio: both ran within seconds of each other
            for peer in PEERS_TO_BEAT:
                records[name][f"vs_{peer}"] = summary(
                    [p / s for p, s in zip(seconds[peer], seconds[name], strict=True)]
                )
    return {
        "model": MODEL,
        "sentences": n_sentences,
        "sentence_set": f"STSb {args.sentences} (unique)",
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "load_average_per_round": loads,
        "cpus": os.cpu_count(),
        "versions": {side: w.hello["versions"] for side, w in workers.items()},
        "threads": {side: w.hello["threads"] for side, w in workers.items()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "variants": records,
    }


def print_table(result: dict) -> None:
    loads = result["load_average_per_round"]
    print(f"\n{result['sentences']} sentences, batch {result['batch_size']}, {result['rounds']} rounds, "
          f"{result['threads']['ours']} threads, load average {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
    print(
        f"{'variant':25s} {'sentences/s (min-max)':>22s} {'STSb':>6s}"
        + "".join(f"{'vs ' + p:>26s}" for p in PEERS_TO_BEAT)
    )
    for name, r in result["variants"].items():
        rate = r["sentences_per_s"]
        spearman = f"{r['spearman']:6.2f}" if r["spearman"] is not None else "     -"
        cells = [f"{rate['median']:.0f} ({rate['min']:.0f}-{rate['max']:.0f})".rjust(22), spearman]
        for peer in PEERS_TO_BEAT:
            ratio = r.get(f"vs_{peer}")
            cells.append(f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})".rjust(25) if ratio else "")
        print(f"{name:25s} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default="/work/venv-onnx/bin/python", help="the peer environment's python")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--sentences", choices=("test", "all"), default="test")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--limit", type=int, help="time the first N sentences (STSb is scored on all test pairs)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch's and onnxruntime's, both sides")
    parser.add_argument("--ours", type=lambda text: text.split(","), default=list(OUR_VARIANTS),
                        help=f"our variants, comma-separated (default: {','.join(OUR_VARIANTS)})")  # fmt: skip
    parser.add_argument("--no-score", dest="score", action="store_false", help="skip STSb (timing only)")
    parser.add_argument("--output", help="JSON file")
    parser.add_argument("--serve", choices=("peer", "ours"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args)
    result = drive(args)
    print_table(result)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
