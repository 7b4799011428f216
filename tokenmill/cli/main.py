"""`tokenmill` command: argument parsing and dispatch to the subcommands."""
from __future__ import annotations

import argparse
import sys

from tokenmill.cli.logging_setup import add_logging_args, add_logging_args_to_subcommands, configure_logging


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that builds an engine (names as in vLLM)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="local HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--model", dest="model_flag", metavar="MODEL", default=None, help="same as the positional MODEL")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["gguf", "int8", "none"],
                        help="weights: gguf = a GGUF file's quantized blocks as stored (default for .gguf on CPU), "
                             "int8 = weight-only int8 for safetensors, none = dense in --dtype (docs/quantization.md)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV pool budget in GiB")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, metavar="BYTES",
                        help="KV pool budget in bytes (vLLM's spelling; overrides --kv-cache-memory)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-memory)")
    parser.add_argument("--block-size", type=int, default=16)
    # --enable-X / --no-enable-X as in vLLM (both on by default)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant mode: a request's output is bit-identical whatever else runs with it")
    parser.add_argument("--kv-offload-memory", type=float, default=0.0,
                        help="host-RAM KV tier below the pool, in GiB (0: off); evicted prefix blocks go there")
    parser.add_argument("--kv-offload-disk-path", default=None,
                        help="directory of the disk KV tier (off by default); reused after a restart of the same model")
    parser.add_argument("--kv-offload-disk-size", type=float, default=None,
                        help="most GiB the disk KV tier keeps (default: 16)")
    parser.add_argument("--kv-offload-disk-drive-size", type=float, default=None,
                        help="GiB of the drive under the disk tier, for the DWPD estimate (default: the tier size)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8_e4m3", "fp8"),
                        help="KV cache storage: auto (the model's dtype), or int8 / fp8_e4m3 (fp8) with a scale per "
                             "token and KV head: about twice the tokens of bf16 in the same memory (docs/kv_cache_dtype.md)")
    parser.add_argument("--state-checkpoint-interval", type=int, default=8, metavar="BLOCKS",
                        help="hybrid linear-attention models: keep the linear layers' state every BLOCKS blocks for "
                             "prefix caching (docs/hybrid_models.md)")
    parser.add_argument("--state-cache-memory", type=float, default=None, metavar="GIB",
                        help="hybrid linear-attention models: GiB for the state pool (up to --max-num-seqs live "
                             "slots, the rest prefix-cache checkpoints; default: --max-num-seqs of each)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda or cuda:N")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: fraction of device memory for weights + activations + KV cache")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode steps without CUDA graphs")
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                        help="CPU: run every layer on torch's ops instead of the compiled C kernels")
    parser.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                        help='constrained decoding, e.g. \'{"backend": "xgrammar"}\'; backends: auto (= guidance, '
                             "llguidance), guidance, xgrammar")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve PEFT LoRA adapters, many in one batch (CPU)")
    parser.add_argument("--max-loras", type=int, default=1,
                        help="adapter slots: the most distinct adapters in one step (others wait their turn)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters kept loaded in host memory, LRU (default: --max-loras)")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help='publish KV cache events for a KV-aware router, e.g. \'{"enable_kv_cache_events": true, '
                             '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (docs/kv_events.md)')
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_max": 5}\'; outputs are unchanged (docs/spec_decode.md)')
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help='prefill/decode disaggregation, e.g. \'{"kv_role": "kv_producer"}\' on a prefill worker and '
                             '\'{"kv_role": "kv_consumer"}\' on a decode worker (docs/pd_disaggregation.md)')


def kv_cache_gib(args: argparse.Namespace) -> float:
    """The KV pool budget in GiB: ``--kv-cache-memory-bytes`` / 2**30 when given, else ``--kv-cache-memory``."""
    if getattr(args, "kv_cache_memory_bytes", None) is not None:
        return args.kv_cache_memory_bytes / 2**30
    return args.kv_cache_memory


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM`` / ``LLMEngine`` keyword arguments the engine flags of ``args`` give."""
    return dict(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=kv_cache_gib(args),
        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed, num_threads=args.num_threads, deterministic=args.deterministic,
        kv_offload_memory=args.kv_offload_memory, kv_offload_disk_path=args.kv_offload_disk_path,
        kv_offload_disk_size=args.kv_offload_disk_size, kv_offload_disk_drive_size=args.kv_offload_disk_drive_size,
        kv_cache_dtype=args.kv_cache_dtype, state_checkpoint_interval=args.state_checkpoint_interval,
        state_cache_memory=args.state_cache_memory,
        device=args.device, gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        cpu_kernels=args.cpu_kernels, structured_outputs_config=args.structured_outputs_config,
        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, kv_events_config=args.kv_events_config,
        speculative_config=args.speculative_config, kv_transfer_config=args.kv_transfer_config,
        quantization=args.quantization,
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Sampling flags of ``generate`` and ``chat``; unset ones follow the model's generation_config."""
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=None,
                        help="0: greedy, the same text every run (default: the model's generation_config, often 1.0)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


def sampling_params(args: argparse.Namespace):
    """The ``SamplingParams`` of the sampling flags (raises ValueError naming a bad one)."""
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def print_startup_line(llm) -> None:
    """One stderr line with the model, dtype, device, ISA path and kernel choice."""
    from tokenmill.cli.startup_line import startup_line

    print(startup_line(llm.engine), file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate for each prompt and print ``### prompt`` then the text; returns the exit code."""
    from tokenmill.engine.llm import LLM

    params = sampling_params(args)  # validate before the model loads
    if not all(args.prompt):
        raise ValueError("prompt must not be empty")
    llm = LLM(**engine_kwargs(args))
    print_startup_line(llm)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(list(args.prompt), params)
    for prompt, output in zip(args.prompt, outputs):
        print(f"### {prompt}\n{output.outputs[0].text}\n")
    llm.close()  # saves cached KV to the disk tier, if one is configured
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Read user turns from stdin (empty line or EOF ends) and print each reply; returns the exit code."""
    from tokenmill.engine.llm import LLM

    params = sampling_params(args)  # validate before the model loads
    llm = LLM(**engine_kwargs(args))
    print_startup_line(llm)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("tokenmill chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params)[0].outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
    llm.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``tokenmill`` parser with every subcommand; each takes ``--log-level`` and ``-v`` too."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill LLM inference engine")
    add_logging_args(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_engine_args_no_positional(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)

    for name, module in (("serve", "tokenmill.cli.serve"), ("bench", "tokenmill.cli.bench"), ("plan", "tokenmill.cli.plan"),
                         ("router", "tokenmill.cli.router")):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)
    add_logging_args_to_subcommands(parser)
    return parser


def add_engine_args_no_positional(parser: argparse.ArgumentParser) -> None:
    """Engine flags for subcommands whose positional arguments are prompts (model via --model)."""
    tmp = argparse.ArgumentParser(add_help=False)
    add_engine_args(tmp)
    for action in tmp._actions:
        if action.dest == "help" or (action.dest == "model" and not action.option_strings):
            continue
        parser._add_action(action)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, set up logging and run the subcommand; returns the exit code (2: bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "model_flag"):  # `--model X` and a positional X mean the same
        args.model = args.model_flag or getattr(args, "model", None)
    configure_logging(args)
    try:
        return args.func(args)
    except ValueError as exc:
        from tokenmill.config import ConfigError

        print(f"error: {exc.for_cli() if isinstance(exc, ConfigError) else exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
