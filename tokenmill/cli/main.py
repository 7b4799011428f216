"""`tokenmill` command: argument parsing and dispatch to the subcommands."""
from __future__ import annotations

import argparse
import sys

from tokenmill.cli.logging_setup import add_logging_args, add_logging_args_to_subcommands, configure_logging
from tokenmill.engine_args import EngineArgs
from tokenmill.startup_gc import pause_for_startup, resume_after_startup


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM`` keyword arguments the engine flags of ``args`` give (``EngineArgs.from_cli_args``)."""
    return EngineArgs.from_cli_args(args).kwargs()


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


# subcommands defined in their own modules (each with a ``register(subparsers)``)
_SUBCOMMAND_MODULES = (("serve", "tokenmill.cli.serve"), ("bench", "tokenmill.cli.bench"), ("plan", "tokenmill.cli.plan"),
                       ("router", "tokenmill.cli.router"))


def named_subcommand(argv: list[str]) -> str | None:
    """The module-defined subcommand ``argv`` runs (its first word that is not an option or an option's
    value), or None (another command, none, or the top-level help asked for first)."""
    words = iter(argv)
    for word in words:
        if word in ("-h", "--help"):  # the top-level help lists every subcommand
            return None
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word if word in dict(_SUBCOMMAND_MODULES) else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``tokenmill`` parser with every subcommand; each takes ``--log-level`` and ``-v`` too.

    ``only``: of the module-defined subcommands (serve, bench, plan, router), register just this one
    (``main`` passes the one argv names: importing the others costs 50 ms of a server's start)."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill LLM inference engine")
    add_logging_args(parser, top_level=True)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    EngineArgs.add_cli_args(gen, positional=False)  # the positional arguments are prompts: the model is --model
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate, builds_engine=True)

    chat = sub.add_parser("chat", help="interactive chat with the model")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat, builds_engine=True)

    for name, module in _SUBCOMMAND_MODULES:
        if only is not None and name != only:
            continue
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)
    add_logging_args_to_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, set up logging and run the subcommand; returns the exit code (2: bad input)."""
    pause_for_startup()  # until the engine has loaded (tokenmill/startup_gc.py)
    try:
        parser = build_parser(named_subcommand(sys.argv[1:] if argv is None else argv))
        args = parser.parse_args(argv)
        if not getattr(args, "builds_engine", False):
            resume_after_startup()
        if hasattr(args, "model_flag"):  # `--model X` and a positional X mean the same
            args.model = args.model_flag or getattr(args, "model", None)
        configure_logging(args)
        return args.func(args)
    except ValueError as exc:
        from tokenmill.config import ConfigError

        print(f"error: {exc.for_cli() if isinstance(exc, ConfigError) else exc}", file=sys.stderr)
        return 2
    finally:
        resume_after_startup()


if __name__ == "__main__":
    sys.exit(main())
