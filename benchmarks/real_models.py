"""Real model shapes against llama.cpp's llama-server (issue 40, item 5); benchmarks/real_models.sh drives it.

Popular models are benchmarked by their *shape*: a model with random weights and the published
config of, e.g., Llama-3.2-1B runs exactly the matrices, norms, RoPE and vocabulary of the real one,
so its decode speed is the real model's (nothing is downloaded from a model hub). The steps:

``make``       For each shape: the transformers model of the published config (``SHAPES`` below) on the
               meta device, its checkpoint written tensor by tensor in ``save_pretrained``'s layout (bf16
               safetensors shards, per-expert tensors for MoE shapes), weights normal(0, 0.02), norms 1, with
               the SmolLM2 tokenizer (taken from the embedded GGUF; none of these models' own tokenizers
               is available offline); convert it with llama.cpp's own ``convert_hf_to_gguf.py`` to F16 (Q8_0
               for shapes too large for an F16 file beside the checkpoint: DeepSeek-V2-Lite), then quantize
               it with ``llama-quantize`` to each format. Files go to
               ``$TOKENMILL_CACHE_DIR/real_models/<shape>/<shape>-<FORMAT>.gguf`` (default
               ``~/.cache/tokenmill``), outside the repository, and are made once: an existing file is
               reused, a half-written one never has the final name.
``bandwidth``  This machine's memory read bandwidth: ``threads`` threads each summing their share of
               a 2 GiB array, best of several passes.
``footprint``  What a GGUF's batch-1 decode step reads: the bytes of every tensor in the file (all
               layers' matrices, norms, biases, the LM head) except the token embedding when the file has
               a separate ``output.weight`` (then one embedding row is read per token); with tied
               embeddings the embedding *is* the LM head and is counted whole. Mixture-of-experts files
               count k of E experts per token (the active bytes), and a 32-request step the share of the
               experts 32 tokens route to (``bytes_per_step``). The KV cache is not
               counted (under 1% of the weights at these prompt lengths). Also the tensor type mix.
``run``        For each shape, format and workload, ``REPEATS`` runs of ``tokenmill bench compare
               --peer llama-server`` (tokenmill then llama-server in each run, so the engines alternate),
               each run's JSON kept; then ``report``.
``report``     Medians over the repeats of each engine's figures and of the tokenmill/llama-server ratio
               measured within each run, and next to every decode figure its share of the
               memory-bandwidth roofline (bytes read per token / measured read bandwidth).

Workloads (``WORKLOADS``): ``batch1``: 4 requests one at a time, a 53-token random prompt, 128 streamed
tokens (decode tok/s = 1 / mean TPOT); ``c32``: 32 such requests at once (64 new tokens each for shapes
of 1.5 B parameters and more), whose per-request decode rate is the step rate, so it too is set against
the roofline (a step at batch 32 reads the weights once); ``ttft512``: 4 requests one at a time, a
512-token prompt, 1 new token: the time to first token.

About the vocabulary: every shape keeps its published ``vocab_size`` (embedding and LM head of the real
size), while the tokenizer is SmolLM2's 49,152 tokens: llama.cpp's converter pads the vocabulary with
unused ``[PAD<i>]`` entries up to ``vocab_size``, as it does for real models whose config counts more
rows than their tokenizer. The random rows of those padding entries are drawn 10x smaller, so greedy
decoding mostly picks real tokens (what is computed per token is the same). The benchmark's random
prompts are drawn from the whole padded vocabulary.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FORMATS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")
WORKLOADS = ("batch1", "c32", "ttft512")
INIT_STD = 0.02
PAD_ROW_SCALE = 0.1


@dataclass(frozen=True)
class Shape:
    """One published model: its name on the hub (for the record only), transformers ``model_type`` and
    the config.json fields that fix its shape."""

    published: str
    model_type: str
    config: dict
    # The format convert_hf_to_gguf.py writes, from which llama-quantize makes the others ("F16"; "Q8_0" for
    # shapes whose F16 file would not fit the disk beside the bf16 checkpoint: then --allow-requantize).
    base: str = "F16"


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192}

# Published config.json values (hidden size, layers, MLP width, heads, KV heads, head size, vocabulary,
# tied embeddings, RoPE, norm epsilon). The first four are the default set.
SHAPES: dict[str, Shape] = {
    "llama3.2-1b": Shape("meta-llama/Llama-3.2-1B", "llama", dict(
        hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE)),
    "qwen2.5-1.5b": Shape("Qwen/Qwen2.5-1.5B-Instruct", "qwen2", dict(
        hidden_size=1536, num_hidden_layers=28, intermediate_size=8960, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=32768, rope_theta=1000000.0, use_sliding_window=False)),
    "smollm2-1.7b": Shape("HuggingFaceTB/SmolLM2-1.7B-Instruct", "llama", dict(
        hidden_size=2048, num_hidden_layers=24, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=8192, rope_theta=130000.0)),
    "qwen3-1.7b": Shape("Qwen/Qwen3-1.7B", "qwen3", dict(
        hidden_size=2048, num_hidden_layers=28, intermediate_size=6144, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1000000.0)),
    # More shapes, by name only (SHAPES=...).
    "qwen2.5-0.5b": Shape("Qwen/Qwen2.5-0.5B-Instruct", "qwen2", dict(
        hidden_size=896, num_hidden_layers=24, intermediate_size=4864, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=32768, rope_theta=1000000.0, use_sliding_window=False)),
    "qwen3-0.6b": Shape("Qwen/Qwen3-0.6B", "qwen3", dict(
        hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1000000.0)),
    "llama3.2-3b": Shape("meta-llama/Llama-3.2-3B", "llama", dict(
        hidden_size=3072, num_hidden_layers=28, intermediate_size=8192, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE)),
    "qwen3-4b": Shape("Qwen/Qwen3-4B", "qwen3", dict(
        hidden_size=2560, num_hidden_layers=36, intermediate_size=9728, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1000000.0)),
    # Mixture-of-experts shapes (issue 43): a step reads its tokens' experts only (see ``footprint``).
    "olmoe-1b-7b": Shape("allenai/OLMoE-1B-7B-0924", "olmoe", dict(
        hidden_size=2048, num_hidden_layers=16, intermediate_size=1024, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        vocab_size=50304, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=4096,
        rope_theta=10000.0)),
    "deepseek-v2-lite": Shape("deepseek-ai/DeepSeek-V2-Lite-Chat", "deepseek_v2", dict(
        hidden_size=2048, num_hidden_layers=27, intermediate_size=10944, moe_intermediate_size=1408,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400,
        tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
        base="Q8_0"),
}
DEFAULT_SHAPES = ("llama3.2-1b", "qwen2.5-1.5b", "smollm2-1.7b", "qwen3-1.7b")
# Not a shape: the embedded SmolLM2-135M-Instruct Q4_1 file, benchmarked as shipped (SHAPES=embedded).
EMBEDDED = "embedded"
# Shapes with at least this many parameters get 64 new tokens per request in ``c32`` (128 below).
C32_SHORT_FROM_PARAMS = 1.5e9


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- paths and the llama.cpp tools

def cache_root() -> Path:
    """``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill``."""
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill")


def model_path(shape: str, fmt: str, root: Path | None = None) -> Path:
    """``<cache>/real_models/<shape>/<shape>-<FORMAT>.gguf``."""
    return (root or cache_root() / "real_models") / shape / f"{shape}-{fmt}.gguf"


def tools_prefix() -> Path:
    """The llama.cpp tools: ``$LLAMA_CPP_TOOLS``, else the cached build of scripts/build_llama_server.sh;
    ``bin/llama-quantize`` and ``convert/convert_hf_to_gguf.py`` (with ``convert/gguf-py``) in it."""
    from tokenmill.bench.llama_server import default_binary_path

    if os.environ.get("LLAMA_CPP_TOOLS"):
        return Path(os.environ["LLAMA_CPP_TOOLS"]).expanduser()

    return default_binary_path().parent.parent


def converter_env(prefix: Path) -> dict[str, str]:
    """Environment for convert_hf_to_gguf.py: its own gguf-py first on the path, plus PyYAML (which that
    gguf-py imports) installed once beside it with pip where this Python lacks it."""
    deps = prefix / "convert" / "pydeps"
    env = dict(os.environ)
    probe = subprocess.run([sys.executable, "-c", "import yaml"], capture_output=True)
    if probe.returncode != 0 and not (deps / "yaml").is_dir():
        log(f"installing PyYAML for the converter into {deps}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), "pyyaml"], check=True)
    parts = [str(prefix / "convert" / "gguf-py"), str(deps), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    env.pop("NO_LOCAL_GGUF", None)
    return env


# ---------------------------------------------------------------- making the files

def smollm2_tokenizer():
    """The SmolLM2 tokenizer of the embedded GGUF, as transformers rebuilds it (a fast BPE tokenizer whose
    pre-tokenizer llama.cpp's converter recognises by its hash as ``smollm``)."""
    from transformers import AutoTokenizer

    from tokenmill.models.default_model import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def checkpoint_tensors(name: str, model) -> list[tuple[str, tuple[int, ...]]]:
    """The (name, shape) of every tensor of ``model``'s checkpoint in the layout ``save_pretrained`` writes:
    transformers keeps a MoE layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj`` [E, H, I]) and splits them per expert on save (``mlp.experts.{e}.gate_proj /
    up_proj / down_proj.weight``), which is what llama.cpp's converter reads."""
    out = []
    for pname, p in model.named_parameters():
        shape = tuple(p.shape)
        if pname.endswith("mlp.experts.gate_up_proj"):
            head = pname[:-len("gate_up_proj")]
            half = shape[1] // 2
            for e in range(shape[0]):
                out += [(f"{head}{e}.gate_proj.weight", (half, shape[2])), (f"{head}{e}.up_proj.weight", (half, shape[2]))]
        elif pname.endswith("mlp.experts.down_proj"):
            head = pname[:-len("down_proj")]
            out += [(f"{head}{e}.down_proj.weight", shape[1:]) for e in range(shape[0])]
        elif pname.endswith(("_proj", "experts")) and p.dim() == 3:
            raise ValueError(f"{name}: fused tensor {pname} {shape} has no known per-expert layout")
        else:
            out.append((pname, shape))
    return out


def build_hf_model(name: str, out_dir: Path, seed: int = 0, shard_bytes: int = 2 << 30) -> None:
    """Write the random-weight HF checkpoint of shape ``name`` (bf16 safetensors, config, tokenizer).

    The model is built on the meta device (no memory) and its tensors are drawn and written shard by shard
    (``shard_bytes`` each, with the usual ``model.safetensors.index.json``), so a 16 B-parameter shape needs
    one shard of memory, not 32 GB. Weights normal(0, 0.02), RMSNorm gains 1, the unused vocabulary rows 10x
    smaller (module docstring)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = SHAPES[name]
    tokenizer = smollm2_tokenizer()
    n_tok = len(tokenizer)
    if n_tok > shape.config["vocab_size"]:
        raise ValueError(f"{name}: the tokenizer has {n_tok} tokens, more than vocab_size {shape.config['vocab_size']}")
    # Special token ids are the tokenizer's: the published ones (e.g. Llama 3's 128000) would be padding here.
    config = AutoConfig.for_model(shape.model_type, **shape.config, initializer_range=INIT_STD,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    config.torch_dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = checkpoint_tensors(name, model)
    gen = torch.Generator().manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    weight_map: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        index = len(files) + 1
        fname = f"model-{index:05d}.safetensors"
        save_file(shards[-1], str(out_dir / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in shards[-1]})
        shards[-1] = {}

    n_params = 0
    for tname, tshape in tensors:
        if tname.endswith("norm.weight"):  # RMSNorm gains (layer norms, final norm, q/k norms, MLA's latent norms)
            t = torch.ones(tshape, dtype=torch.bfloat16)
        else:  # matrices, embeddings, the LM head, routers, Qwen2's q/k/v biases
            t = torch.empty(tshape, dtype=torch.float32).normal_(0.0, INIT_STD, generator=gen)
            if "embed_tokens" in tname or "lm_head" in tname:
                t[n_tok:] *= PAD_ROW_SCALE  # rows of unused [PAD] vocabulary entries
            t = t.to(torch.bfloat16)
        n_params += t.numel()
        if size and size + t.numel() * 2 > shard_bytes:
            flush()
            size = 0
        shards[-1][tname] = t
        size += t.numel() * 2
    flush()
    final = []
    for i, fname in enumerate(files, 1):  # the usual model-0000i-of-0000n names
        target = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        (out_dir / fname).rename(out_dir / target)
        final.append(target)
    rename = dict(zip(files, final))
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": n_params * 2}, "weight_map": {k: rename[v] for k, v in weight_map.items()}},
        indent=1) + "\n")
    config.architectures = [type(model).__name__]  # what save_pretrained records; the converter reads it
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log(f"{name}: {n_params / 1e9:.2f} B parameters (shape of {shape.published}), tokenizer SmolLM2 "
        f"({n_tok} tokens, vocabulary padded to {shape.config['vocab_size']}) -> {out_dir}")


def make_shape(name: str, formats: list[str], root: Path | None, threads: int, keep_hf: bool = False) -> list[Path]:
    """Make (or find) ``name``'s base GGUF (F16, or the shape's ``base``) and each quantized format; returns the
    requested files' paths."""
    prefix = tools_prefix()
    convert = prefix / "convert" / "convert_hf_to_gguf.py"
    quantize = prefix / "bin" / "llama-quantize"
    base_fmt = SHAPES[name].base
    base = model_path(name, base_fmt, root)
    wanted = [model_path(name, fmt, root) for fmt in formats]
    if all(p.is_file() for p in wanted):
        return wanted
    if not base.is_file():
        if not convert.is_file():
            raise SystemExit(f"no {convert}: run `bash scripts/build_llama_server.sh` first")
        hf_dir = base.parent / "hf"
        if not (hf_dir / "config.json").is_file() or not any(hf_dir.glob("*.safetensors")):
            shutil.rmtree(hf_dir, ignore_errors=True)
            build_hf_model(name, hf_dir)
        tmp = base.with_suffix(".tmp")
        log(f"{name}: converting to {base_fmt} with {convert}")
        subprocess.run(["nice", "-n", "19", sys.executable, __file__, "convert-hf", str(convert), str(hf_dir),
                        "--outtype", base_fmt.lower(), "--outfile", str(tmp)], check=True, env=converter_env(prefix))
        tmp.rename(base)
        if not keep_hf:
            shutil.rmtree(hf_dir)
    for fmt, out in zip(formats, wanted):
        if out.is_file() or fmt == base_fmt:
            continue
        if not quantize.is_file():
            raise SystemExit(f"no {quantize}: run `bash scripts/build_llama_server.sh` first")
        tmp = out.with_suffix(".tmp")
        log(f"{name}: llama-quantize {fmt} (from {base_fmt})")
        requant = ["--allow-requantize"] if base_fmt != "F16" else []
        done = subprocess.run(["nice", "-n", "19", str(quantize), *requant, str(base), str(tmp), fmt, str(threads)],
                              capture_output=True, text=True)  # a line per tensor: shown only when it fails
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize {fmt} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        tmp.rename(out)
    return wanted


def run_converter(convert: str, argv: list[str]) -> None:
    """Run llama.cpp's convert_hf_to_gguf.py (``convert``) with ``argv``, in this process, after one change
    to transformers: it no longer forces its Qwen2 tokenizer class on ``qwen2`` checkpoints. transformers 5
    lists qwen2 among the models whose declared tokenizer class it distrusts and rebuilds their tokenizer
    with Qwen's own pre-tokenizer regex; on the stand-in SmolLM2 tokenizer that gives a pre-tokenizer
    llama.cpp's converter does not know (it identifies one by hashing the tokens of a test text) and the
    conversion stops. With the class the checkpoint declares, the hash is SmolLM2's (``smollm``)."""
    import runpy

    try:
        from transformers.models.auto import tokenization_auto

        tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard("qwen2")
    except (ImportError, AttributeError):
        pass
    sys.path.insert(0, str(Path(convert).resolve().parent))  # its `conversion` package, as `python convert...` would
    sys.argv = [convert, *argv]
    runpy.run_path(convert, run_name="__main__")


# ---------------------------------------------------------------- what a decode step reads

def footprint(path: Path) -> dict:
    """Parameters, bytes read per decode token (see the module docstring) and tensor type mix of a GGUF.

    Mixture-of-experts files (``<arch>.expert_count`` E and ``<arch>.expert_used_count`` k in the metadata):
    a token reads k of a layer's E experts, so the stacked expert tensors (``*_exps.weight``) count k/E of
    their bytes in ``bytes_per_token`` (the active bytes); ``bytes_per_step(fp, b)`` gives a step of b tokens,
    whose tokens between them use 1 - (1 - k/E)^b of the experts on average (independent uniform routing)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def meta_int(key: str) -> int:
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.parts[-1][0]) if field is not None else 0

    n_expert, n_used = meta_int("expert_count"), meta_int("expert_used_count")
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    tied = "output.weight" not in tensors
    dense = experts = 0
    for t in tensors.values():
        if t is embd and not tied:
            dense += int(t.n_bytes) // int(t.shape[-1])  # one row: shape is innermost-first (n_embd, n_vocab)
        elif n_expert and "_exps." in t.name:
            experts += int(t.n_bytes)
        else:
            dense += int(t.n_bytes)
    types: Counter = Counter()
    type_bytes: Counter = Counter()
    for t in tensors.values():
        types[t.tensor_type.name] += 1
        type_bytes[t.tensor_type.name] += int(t.n_bytes)
    params = sum(int(t.n_elements) for name, t in tensors.items() if name != "rope_freqs.weight")
    active = params
    if n_expert:
        active -= sum(int(t.n_elements) for t in tensors.values() if "_exps." in t.name) * (n_expert - n_used) // n_expert
    fp = {"file": str(path), "file_bytes": path.stat().st_size, "params": params, "active_params": active,
          "tied_embeddings": tied, "dense_bytes": dense, "expert_bytes": experts, "expert_count": n_expert,
          "expert_used_count": n_used, "types": dict(types), "type_bytes": dict(type_bytes)}
    fp["bytes_per_token"] = bytes_per_step(fp, 1)
    return fp


def bytes_per_step(fp: dict, tokens: int) -> int:
    """Weight bytes a decode step of ``tokens`` tokens reads (``footprint``): everything but the experts, plus
    the expected share of the experts that at least one of the tokens routes to."""
    n, k = fp.get("expert_count", 0), fp.get("expert_used_count", 0)
    if not n:
        return fp.get("dense_bytes", fp.get("bytes_per_token", 0))
    share = k / n if tokens == 1 else 1.0 - (1.0 - k / n) ** tokens
    return int(fp["dense_bytes"] + share * fp["expert_bytes"])


def type_mix(fp: dict) -> str:
    """``Q4_K 113 (62%), Q6_K 17 ...``: tensor count and share of the bytes per type, largest first."""
    total = sum(fp["type_bytes"].values())
    order = sorted(fp["types"], key=lambda k: -fp["type_bytes"][k])
    return ", ".join(f"{k} {fp['types'][k]} ({100 * fp['type_bytes'][k] / total:.0f}%)" for k in order)


# ---------------------------------------------------------------- read bandwidth

def measure_bandwidth(threads: int, gib: float = 2.0, passes: int = 7) -> float:
    """Read bandwidth in bytes/s: ``threads`` threads each sum their contiguous share of a ``gib`` GiB
    int64 array (numpy releases the GIL in the reduction); best wall time of ``passes`` passes."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    data = np.ones(int(gib * (1 << 30)) // 8, dtype=np.int64)
    parts = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(passes):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


# ---------------------------------------------------------------- running the workloads

def workload_args(workload: str, params: float) -> list[str]:
    """``bench compare`` dataset flags of one workload (see the module docstring)."""
    if workload == "batch1":
        return ["--dataset-name", "random", "--random-input-len", "53", "--random-output-len", "128",
                "--num-prompts", "4", "--max-concurrency", "1"]
    if workload == "c32":
        out = 64 if params >= C32_SHORT_FROM_PARAMS else 128
        return ["--dataset-name", "random", "--random-input-len", "53", "--random-output-len", str(out),
                "--num-prompts", "32", "--max-concurrency", "32"]
    if workload == "ttft512":
        return ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "1",
                "--num-prompts", "4", "--max-concurrency", "1"]
    raise SystemExit(f"unknown workload {workload!r} (known: {', '.join(WORKLOADS)})")


@functools.lru_cache(maxsize=2)
def _workload_tokenizer(model: Path):
    """The model's tokenizer as bench compare loads it (rebuilt from the GGUF: seconds, so kept)."""
    from tokenmill.bench.workload import load_tokenizer

    return load_tokenizer(str(model))


def run_peer_only(model: Path, args: list[str], threads: int, peer_args: list[str], result_file: Path,
                  binary: str | None = None) -> None:
    """llama-server alone on one workload, through bench compare's own client and server handling, written
    in bench compare's JSON layout (``ENGINES=llama-server``: for when tokenmill must not run)."""
    from tokenmill.bench.llama_server import ServerPeer
    from tokenmill.bench.server_compare import ServerCompareConfig, run_llama_server
    from tokenmill.bench.workload import DatasetConfig, build_workload

    flags = dict(zip(args[::2], args[1::2]))
    dataset = DatasetConfig(name="random", num_prompts=int(flags["--num-prompts"]),
                            random_input_len=int(flags["--random-input-len"]),
                            random_output_len=int(flags["--random-output-len"]))
    tokenizer = _workload_tokenizer(model)
    requests = [c.turns[0] for c in build_workload(dataset, tokenizer)]
    conc = int(flags["--max-concurrency"])
    config = ServerCompareConfig(threads=threads, max_concurrency=conc, parallel=min(conc, len(requests)),
                                 peer_args=tuple(peer_args), disable_tqdm=True)
    peer = ServerPeer("llama-server", Path(binary) if binary else None)
    run, command = run_llama_server(peer, model, requests, config, tokenizer)
    record = {"mode": "server", "threads": threads, "runs": [
        {"engine": run.engine, "load_s": run.load_s, "note": run.note, "decode_throughput": run.decode_throughput,
         **run.metrics.summary()}], "ratios": {}, "commands": {"llama-server": command}}
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(record, indent=2, default=str) + "\n")
    m = run.metrics
    log(f"  llama-server: decode {run.decode_throughput or 0:.1f} tok/s, output {m.output_throughput:.1f} tok/s, "
        f"TTFT {m.ttft.mean_ms:.0f} ms, failed {m.failed}")


def run_all(opts: argparse.Namespace) -> None:
    """Make the files, measure the bandwidth, run every (shape, format, workload) ``repeats`` times, report."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for shape in opts.shapes:
        if shape == EMBEDDED:  # the shipped file as it is, whatever FORMATS says: a quick check of the plumbing
            from tokenmill.models.default_model import default_model_path

            files[shape, "Q4_1"] = default_model_path()
            continue
        for fmt, path in zip(opts.formats, make_shape(shape, opts.formats, None, opts.threads)):
            files[shape, fmt] = path
    if opts.make_only:
        for path in files.values():
            print(path)
        return
    bw = measure_bandwidth(opts.threads)
    (out / "bandwidth.json").write_text(json.dumps({"threads": opts.threads, "bytes_per_s": bw}) + "\n")
    log(f"read bandwidth with {opts.threads} threads: {bw / 1e9:.1f} GB/s")
    peer = "llama-server" + (f"={opts.llama_server}" if opts.llama_server else "")
    for (shape, fmt), path in files.items():
        fp = footprint(path)
        (out / shape / fmt).mkdir(parents=True, exist_ok=True)
        (out / shape / fmt / "footprint.json").write_text(json.dumps(fp, indent=2) + "\n")
        for workload in opts.workloads:  # this run's results replace earlier ones of the same workloads
            for old in (out / shape / fmt).glob(f"{workload}-*.json"):
                old.unlink()
        # Repeats outermost: a slow spell of the machine spreads over the workloads instead of hitting one.
        for i in range(1, opts.repeats + 1):
            for workload in opts.workloads:
                args = workload_args(workload, fp["params"])
                result = out / shape / fmt / f"{workload}-{i}.json"
                log(f"== {shape} {fmt} {workload} run {i}/{opts.repeats}")
                if opts.engines == "llama-server":
                    run_peer_only(path, args, opts.threads, opts.peer_args, result, opts.llama_server)
                    continue
                cmd = [str(REPO / ".venv" / "bin" / "tokenmill"), "bench", "compare", str(path), "--peer", peer,
                       "--num-threads", str(opts.threads), "--disable-tqdm", "--result-file", str(result),
                       *args, *opts.tokenmill_args]
                if opts.peer_args:
                    cmd.append("--peer-args=" + " ".join(opts.peer_args))
                done = subprocess.run(cmd, check=False)
                if done.returncode != 0:
                    log(f"   bench compare exited with {done.returncode}; going on")
    report(out, opts.shapes, opts.formats, opts.workloads)


# ---------------------------------------------------------------- the report

def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def report(out: Path, shapes: list[str], formats: list[str], workloads: list[str]) -> None:
    """Print, per shape and format, the median figures of each engine over the repeats, the median of the
    per-run tokenmill/llama-server ratios and each decode rate's share of the bandwidth roofline."""
    bw_file = out / "bandwidth.json"
    bw = json.loads(bw_file.read_text())["bytes_per_s"] if bw_file.is_file() else None
    print(f"read bandwidth: {_fmt(bw and bw / 1e9)} GB/s; roofline = bandwidth / bytes read per token "
          "(weights only); x = tokenmill / llama-server, the median over runs of the ratio within a run (above 1 "
          "is better for tokenmill, except for TTFT)")
    for shape in shapes:
        for fmt in (["Q4_1"] if shape == EMBEDDED else formats):
            d = out / shape / fmt
            if not (d / "footprint.json").is_file():
                continue
            fp = json.loads((d / "footprint.json").read_text())
            roof = bw / fp["bytes_per_token"] if bw else None
            moe = (f" ({fp['active_params'] / 1e9:.2f} B active: {fp['expert_used_count']} of {fp['expert_count']} "
                   f"experts)") if fp.get("expert_count") else ""
            print(f"\n{shape} {fmt}: {fp['params'] / 1e9:.2f} B params{moe}, file {fp['file_bytes'] / 1e9:.2f} GB, "
                  f"{fp['bytes_per_token'] / 1e6:.0f} MB read per token, roofline {_fmt(roof)} tok/s; {type_mix(fp)}")
            print(f"  {'workload':<9} {'runs':>4}  {'tokenmill':>22}  {'llama-server':>22}  {'x':>6}   figure")
            for workload in workloads:
                records = [json.loads(p.read_text()) for p in sorted(d.glob(f"{workload}-*.json"))]
                if not records:
                    continue
                rows = [("decode tok/s", "decode_throughput", "decode_tok_s", True)]
                if workload == "c32":
                    rows = [("output tok/s", "output_throughput", "output_tok_s", False), *rows]
                if workload == "ttft512":
                    rows = [("mean TTFT ms", "mean_ttft_ms", None, False)]
                for label, key, ratio_key, roofline in rows:
                    step_roof = roof
                    if workload == "c32" and bw and fp.get("expert_count"):
                        # a step of 32 requests reads more experts than one token's; its decode rate per
                        # request is the step rate, set against that step's bytes
                        step_roof = bw / bytes_per_step(fp, 32)
                    cells = []
                    for engine in ("tokenmill", "llama-server"):
                        v = _median([r[key] for rec in records for r in rec["runs"] if r["engine"] == engine])
                        share = f" ({100 * v / step_roof:3.0f}% roof)" if roofline and step_roof and v else ""
                        cells.append(_fmt(v) + share)
                    if ratio_key:
                        x = _median([rec["ratios"].get(f"{ratio_key} tokenmill/llama-server") for rec in records])
                    else:  # a latency: the ratio of the two within each run
                        x = _median([_ratio(rec, key) for rec in records])
                    print(f"  {workload:<9} {len(records):>4}  {cells[0]:>22}  {cells[1]:>22}  {_fmt(x, '.2f'):>6}   {label}")


def _ratio(record: dict, key: str) -> float | None:
    by = {r["engine"]: r.get(key) for r in record["runs"]}
    a, b = by.get("tokenmill"), by.get("llama-server")
    return a / b if a and b else None


# ---------------------------------------------------------------- command line

def _words(text: str | None, default: tuple[str, ...]) -> list[str]:
    return text.split() if text and text.strip() else list(default)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("make", "run", "report"):
        s = sub.add_parser(name)
        s.add_argument("--shapes", default=os.environ.get("SHAPES"), help="space-separated (default: the four)")
        s.add_argument("--formats", default=os.environ.get("FORMATS"), help=f"default: {' '.join(FORMATS)}")
        s.add_argument("--workloads", default=os.environ.get("WORKLOADS"), help=f"default: {' '.join(WORKLOADS)}")
        s.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "out" / "real_models")))
        s.add_argument("--threads", type=int, default=int(os.environ.get("THREADS", "2")))
        s.add_argument("--repeats", type=int, default=int(os.environ.get("REPEATS", "3")))
        s.add_argument("--engines", choices=("both", "llama-server"), default=os.environ.get("ENGINES", "both"))
        s.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="binary (default: the cached build)")
        s.add_argument("--peer-args", default=os.environ.get("PEER_ARGS", ""))
        s.add_argument("--tokenmill-args", default=os.environ.get("TOKENMILL_ARGS", ""),
                       help="extra bench compare flags, e.g. '--dtype bfloat16'")
        s.add_argument("--make-only", action="store_true", default=os.environ.get("MAKE_ONLY") == "1")
    sub.add_parser("shapes")
    s = sub.add_parser("bandwidth")
    s.add_argument("--threads", type=int, default=int(os.environ.get("THREADS", "2")))
    s = sub.add_parser("footprint")
    s.add_argument("files", nargs="+", type=Path)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert-hf"]:  # internal: make_shape runs the converter through this (see run_converter)
        run_converter(argv[1], argv[2:])
        return 0
    opts = p.parse_args(argv)
    if opts.cmd == "shapes":
        for name, shape in SHAPES.items():
            print(f"{name:<14} {shape.model_type:<6} {shape.published}{'  (default)' if name in DEFAULT_SHAPES else ''}")
        print(f"{EMBEDDED:<14} llama  the embedded SmolLM2-135M-Instruct Q4_1 file as shipped (run and report only)")
        return 0
    if opts.cmd == "bandwidth":
        print(f"{measure_bandwidth(opts.threads) / 1e9:.1f} GB/s with {opts.threads} threads")
        return 0
    if opts.cmd == "footprint":
        for f in opts.files:
            fp = footprint(f)
            print(f"{f}: {fp['file_bytes'] / 1e9:.2f} GB, {fp['params'] / 1e9:.3f} B params, "
                  f"{fp['bytes_per_token'] / 1e6:.0f} MB read per token ({'tied' if fp['tied_embeddings'] else 'separate'} "
                  f"LM head); {type_mix(fp)}")
        return 0
    opts.shapes = _words(opts.shapes, DEFAULT_SHAPES)
    opts.formats = _words(opts.formats, FORMATS)
    opts.workloads = _words(opts.workloads, WORKLOADS)
    opts.peer_args = opts.peer_args.split()
    opts.tokenmill_args = opts.tokenmill_args.split()
    for s in opts.shapes:
        if s not in SHAPES and not (s == EMBEDDED and opts.cmd != "make"):
            raise SystemExit(f"unknown shape {s!r} (known: {', '.join(SHAPES)})")
    if opts.cmd == "make":
        for shape in opts.shapes:
            for path in make_shape(shape, opts.formats, None, opts.threads):
                print(path)
        return 0
    if opts.cmd == "run":
        run_all(opts)
    else:
        report(Path(opts.out), opts.shapes, opts.formats, opts.workloads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
