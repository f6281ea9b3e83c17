"""maxperf's serving model (perfmodel/serving.py) against published serving measurements, with held-out fits.

    .venv/bin/python bench/serving.py [--json FILE]

Rows: bench/published/serving.csv, each with its citation and the line it was read from: NVIDIA's TensorRT-LLM
performance tables and blog posts (static batches of identical requests on H100 and H200 in FP8, tensor parallel
within one node) and vLLM on TPU v6e and TPU7x (Google's tpu-recipes: the Trillium recipe for Llama 3.3 70B, the
Ironwood recipes for Qwen3-32B and Qwen3-Coder-480B-A35B in FP8; random requests under continuous batching at a fixed
concurrency). Each row's words are what the run ran as maxperf's keys; TensorRT-LLM's grouped-query runs without its
XQA kernel for their group (the H200 launch post's and the 0.6.1 table's Llama 2 70B, the 0.9.0 table's Mistral 7B
and Mixtral 8x7B: docs/serving.md) carry decode_cache_reads=per_query_head, and the 0.9.0 table's Mixtral 8x7B rows,
listed under FP8, run in 16 bits, as that release's mixture-of-experts layer did (it had no FP8 path: docs/serving.md).
Four kinds of figure:

- output tokens/s per GPU of a static batch (TensorRT-LLM's gptSessionBenchmark: batch x output length / the whole
  batch's latency / GPUs), predicted as perfmodel.serving.static_batch_seconds: the prefill of the prompts, then a
  decode step per output token over the growing cache;
- time to first token at batch 1, predicted as the prefill step;
- the median time between output tokens (vLLM's median ITL) with C requests in flight, each of input_len prompt
  tokens and output_len output tokens: a decode step of C sequences at the cache's mean fill, input_len +
  output_len / 2 (the median step is one without a prompt's chunk beside it: at these lengths and the recipe's
  512-token budget a step prefills a chunk of a new prompt a fifth to two fifths of the time);
- output tokens/s per chip of a served benchmark (vLLM's server under InferenceX's benchmark_serving.py: `requests`
  prompts sent at once, `batch` of them in flight, each prompt and output drawn uniformly from `length_ratio` to 1
  times input_len and output_len), predicted as the requests in waves of `batch`: each wave a static batch at the
  mean lengths (its prompts' prefill, then its decode steps), the last wave the remainder; the output tokens over
  the waves' time.

The error is predicted / published - 1 of throughput (tokens/s, or 1 / time). The fitted constants are
DECODE_HBM_EFFICIENCY["gpu"] and ["tpu"] (the share of HBM bandwidth decode reads sustain), each by a grid over
0.40-1.00 on the median |log(predicted / published)| of its own kind's rows. "shipped" is maxperf's constants; "held
out by source" predicts each source's rows with the constants fitted on the other sources' rows only (what users
should expect on runs they were not fitted on); "in-sample" fits all rows.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benches' own helpers
import outfile  # noqa: E402

from maxperf.perfmodel import serving  # noqa: E402
from maxperf.perfmodel.estimate import device_for  # noqa: E402
from maxperf.spec.request import resolve  # noqa: E402

ROWS = ROOT / "bench" / "published" / "serving.csv"
GRID = [round(0.40 + 0.01 * i, 2) for i in range(61)]
METRIC_LABELS = {"output_tokens_per_s_per_gpu": "tok/s/GPU", "ttft_ms": "TTFT", "decode_step_ms": "step",
                 "served_output_tokens_per_s_per_chip": "served tok/s/chip"}
TIMES = ("ttft_ms", "decode_step_ms")  # figures of time, whose throughput is their inverse
KINDS = ("gpu", "tpu")  # the chip kinds whose HBM efficiency is fitted, each on its own rows
# The query heads per KV head (on one GPU, under the row's tensor parallelism) that each TensorRT-LLM release decodes
# with its XQA kernel, reading a KV head's cache once for its group (docs/serving.md): none before XQA (the H200
# launch post ran release 0.5, the table of 0.6.1), groups of 8 from the Falcon-180B post's 0.7a to 0.9.0
# (DecoderXQARunner::shouldUse). Any other grouped-query row ran the masked multi-head attention kernel, reading its
# cache once per query head, and must say so (decode_cache_reads=per_query_head); load_rows checks it.
XQA_GROUPS = {"trtllm-h200-blog": (), "trtllm-v0.6.1": (), "trtllm-falcon-h200-blog": (8,), "trtllm-v0.9.0": (8,)}
PER_QUERY_HEAD = "decode_cache_reads=per_query_head"


@dataclasses.dataclass
class Row:
    id: int
    source: str
    topology: str
    model: str
    batch: int
    input_len: int
    output_len: int
    words: list[str]
    metric: str
    value: float
    requests: int = 0  # a served benchmark's prompts (0: not one)
    length_ratio: float = 1.0  # its lengths drawn uniformly from this to 1 times input_len and output_len

    @property
    def label(self) -> str:
        return (f"{self.model} {self.topology} B{self.batch} {self.input_len}/{self.output_len} "
                f"{METRIC_LABELS[self.metric]}")


def load_rows(path: Path = ROWS) -> list[Row]:
    rows = []
    with open(path) as f:
        for i, r in enumerate(csv.DictReader(f)):
            rows.append(Row(i, r["source"], r["topology"], r["model"], int(r["batch"]), int(r["input_len"]),
                            int(r["output_len"]), r["words"].split(), r["metric"], float(r["value"]),
                            int(r["requests"] or 0), float(r["length_ratio"] or 1.0)))
    for row in rows:
        if row.source not in XQA_GROUPS:
            continue
        per_head = reads_per_query_head(row)
        if (PER_QUERY_HEAD in row.words) != per_head:
            raise ValueError(f"{path.name} row {row.id + 2} ({row.source}, {row.label}): its release "
                             f"{'decodes it per query head' if per_head else 'has XQA for it'}, "
                             f"so its words {'need' if per_head else 'cannot have'} {PER_QUERY_HEAD}")
    return rows


def reads_per_query_head(row: Row) -> bool:
    """Whether a TensorRT-LLM row's release decoded its grouped-query model without XQA (XQA_GROUPS): the query heads
    per KV head on one GPU under the row's mesh."""
    p = request(row)
    group = serving.query_heads_per_kv_head(p.model, dict(p.mesh.sizes))
    return group > 1 and group not in XQA_GROUPS[row.source]


def request(row: Row, batch: int | None = None):
    """The row's serving step as maxperf resolves it, for `batch` sequences (default: the row's)."""
    devices = int(row.topology.rsplit("-", 1)[1])
    words = (*row.words, f"per_device_batch_size={(batch or row.batch) / devices:g}",
             f"max_prefill_predict_length={row.input_len}", f"max_target_length={row.input_len + row.output_len}")
    return _resolved(row.topology, row.model, words)


@functools.cache  # asked of every row by every fit
def _resolved(topology: str, model: str, words: tuple[str, ...]):
    return resolve(topology, model, list(words))


def served_tokens_per_s_per_chip(row: Row, k: serving.ServingConstants) -> float:
    """A served benchmark's output tokens/s per chip: its requests in waves of `batch` at the mean lengths."""
    mean = lambda n: round(n * (1 + row.length_ratio) / 2)  # noqa: E731  (uniform on [ratio n, n])
    prompt, output = mean(row.input_len), mean(row.output_len)
    waves, rest = divmod(row.requests, row.batch)
    seconds = 0.0
    for batch, count in ((row.batch, waves), (rest, 1 if rest else 0)):
        if count:
            p = request(row, batch)
            seconds += count * serving.static_batch_seconds(p.model, p.train, p.mesh, device_for(p.topology),
                                                            p.topology, prompt, output, k)
    return row.requests * output / seconds / p.topology.chips


def predict(row: Row, k: serving.ServingConstants) -> float:
    """The row's figure as maxperf predicts it, in the row's unit."""
    if row.metric == "served_output_tokens_per_s_per_chip":  # resolves a request per wave
        return served_tokens_per_s_per_chip(row, k)
    p = request(row)
    chip = device_for(p.topology)
    b = row.batch / serving.batch_split(dict(p.mesh.sizes), row.batch)  # sequences per batch shard
    if row.metric == "ttft_ms":
        return 1e3 * serving.prefill_phase(p.model, p.train, p.mesh, chip, p.topology, b, row.input_len, k).seconds
    if row.metric == "decode_step_ms":
        context = row.input_len + row.output_len / 2
        return 1e3 * serving.decode_phase(p.model, p.train, p.mesh, chip, p.topology, b, context, k).seconds
    seconds = serving.static_batch_seconds(p.model, p.train, p.mesh, chip, p.topology, row.input_len,
                                           row.output_len, k)
    return row.batch * row.output_len / seconds / p.topology.chips


def error(row: Row, predicted: float) -> float:
    """predicted / published - 1 of throughput."""
    if row.metric in TIMES:
        return row.value / predicted - 1
    return predicted / row.value - 1


def kind(row: Row) -> str:
    """The row's chip kind: "gpu" or "tpu"."""
    return _kind(row.topology, row.model, tuple(row.words))


@functools.cache  # asked of every row by every fit
def _kind(topology: str, model: str, words: tuple[str, ...]) -> str:
    return device_for(resolve(topology, model, list(words)).topology).kind


def on_gpu(row: Row) -> bool:
    return kind(row) == "gpu"


def with_efficiency(fitted: dict[str, float]) -> serving.ServingConstants:
    """The shipped constants with `fitted` (chip kind -> HBM efficiency) in place."""
    return dataclasses.replace(serving.SHIPPED_SERVING, hbm_efficiency=tuple(
        {**dict(serving.SHIPPED_SERVING.hbm_efficiency), **fitted}.items()))


def fit(rows: list[Row]) -> dict[str, float]:
    """Per chip kind, the HBM efficiency with the least median |log(predicted / published)| over that kind's rows of
    `rows`; a kind without rows takes the other's."""
    def best(k: str, mine: list[Row]) -> float:
        def loss(e: float) -> float:
            constants = with_efficiency({k: e})
            return statistics.median(abs(math.log1p(error(r, predict(r, constants)))) for r in mine)
        return min(GRID, key=loss)

    fitted = {k: best(k, mine) for k in KINDS if (mine := [r for r in rows if kind(r) == k])}
    for k in KINDS:
        fitted.setdefault(k, next(iter(fitted.values())))
    return fitted


def summary(errors: list[float]) -> str:
    a = [abs(x) for x in errors]
    return f"n={len(a)} median {100 * statistics.median(a):.1f}% worst {100 * max(a):.1f}%"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.json = outfile.checked(ap, args.json)
    rows = load_rows()
    shipped = {r.id: predict(r, serving.SHIPPED_SERVING) for r in rows}
    in_sample = fit(rows)
    held = {}
    fitted_without = {}
    for source in sorted({r.source for r in rows}):
        fitted = fitted_without[source] = fit([r for r in rows if r.source != source])
        k = with_efficiency(fitted)
        held.update({r.id: predict(r, k) for r in rows if r.source == source})
    k_in = with_efficiency(in_sample)
    print(f"{'row':<48} {'published':>10} {'shipped':>9} {'held out':>9}")
    for r in rows:
        print(f"{r.label:<48} {r.value:>10.4g} {100 * error(r, shipped[r.id]):>+8.1f}% "
              f"{100 * error(r, held[r.id]):>+8.1f}%")
    groups = {"all": rows, "static batch tok/s": [r for r in rows if r.metric == "output_tokens_per_s_per_gpu"],
              "TTFT": [r for r in rows if r.metric == "ttft_ms"],
              "TPU decode step": [r for r in rows if r.metric == "decode_step_ms"],
              "TPU served tok/s": [r for r in rows if r.metric == "served_output_tokens_per_s_per_chip"],
              "GPU": [r for r in rows if on_gpu(r)], "TPU": [r for r in rows if not on_gpu(r)]}
    out = {"rows": len(rows), "fitted_hbm_efficiency": in_sample, "fitted_without": fitted_without,
           "shipped_hbm_efficiency": {k: serving.SHIPPED_SERVING.efficiency(k) for k in KINDS}, "groups": {}}
    for name, rs in groups.items():
        lines = {"shipped": [error(r, shipped[r.id]) for r in rs],
                 "held out by source": [error(r, held[r.id]) for r in rs],
                 "in-sample": [error(r, predict(r, k_in)) for r in rs]}
        for kind, errs in lines.items():
            print(f"{name:<20} {kind:<20} {summary(errs)}")
        out["groups"][name] = {kind: {"median": statistics.median(abs(x) for x in errs),
                                      "worst": max(abs(x) for x in errs)} for kind, errs in lines.items()}
    print(f"fitted HBM efficiency: {in_sample} in-sample; without each source: {fitted_without}")
    if args.json:
        outfile.write(args.json, out, indent=2)
    return out


if __name__ == "__main__":
    main()
