"""EngineArgs: every engine option written once: its name, type, default, help and command-line spelling.

``LLM(**kwargs)``, ``create_engine_config()`` (the frozen ``EngineConfig``), the flags of every subcommand that
builds an engine (``add_cli_args`` / ``from_cli_args``), ``ServerConfig`` and ``tokenmill plan`` derive from
these fields, as vLLM's ``EngineArgs``. Help texts name other options as `name`: a flag on the command line,
the keyword in docstrings. Imports the standard library and ``tokenmill.config`` only: the router process
loads this module, so never torch, numpy or ``tokenmill.engine``.
"""
import argparse
import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tokenmill.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    LoRAConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    check_bool,
)

if TYPE_CHECKING:
    from tokenmill.kv_transfer.config import KVTransferConfig
    from tokenmill.spec_decode.config import SpeculativeConfig

_NAME = re.compile(r"`(\w+)`")


@dataclass(frozen=True)
class UnitAlias:
    """A second flag for an option, in another unit (vLLM's ``--kv-cache-memory-bytes`` for GiB)."""

    flag: str
    type: type
    metavar: str
    help: str
    to_option: Callable[[Any], Any]  # the flag's value -> the option's value


@dataclass(frozen=True)
class CliSpelling:
    """How an option is typed on the command line; vLLM's names.

    ``flag`` None: ``--`` + the name with dashes. A bool option whose default is True gets
    ``--name`` / ``--no-name`` unless ``flag`` is its ``--no-`` form alone; one whose default is False is a
    switch. ``json``: a JSON object given as text (a dict or the config object in Python), shown with
    ``example``. ``positional``: also the subcommand's optional positional argument (the model).
    """

    flag: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    json: bool = False
    example: str | None = None
    alias: UnitAlias | None = None
    positional: bool = False


def option(default: Any, help: str, **cli: Any) -> Any:
    """An ``EngineArgs`` field: its default, its help text and its ``CliSpelling`` keywords."""
    return field(default=default, metadata={"help": help, "cli": CliSpelling(**cli)})


@dataclass(frozen=True)
class EngineArgs:
    """The engine options (``LLM(...)`` keywords; flags of serve, generate, chat, bench offline/compare, plan).

    ``create_engine_config()`` checks them (``ConfigError`` naming the option) and builds the ``EngineConfig``.
    """

    model: str | None = option(
        None, "local HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct); never "
        "downloads", flag="--model", positional=True)
    dtype: str = option(
        "auto", "activations and dense weights: auto (CUDA: bfloat16; CPU: float32 for a float32 checkpoint or a "
        "CPU without bf16 arithmetic, else bfloat16), float32 or bfloat16",
        choices=("auto", "float32", "bfloat16"))
    quantization: str | None = option(
        None, "weights: gguf = a GGUF file's quantized blocks as stored (default for .gguf on CPU), int8 = "
        "weight-only int8 for safetensors, none = dense in `dtype` (docs/quantization.md)",
        choices=("gguf", "int8", "none"))
    max_model_len: int | None = option(
        None, "longest prompt + output of a request, in tokens (default: the model's max_position_embeddings); "
        "a longrope model (Phi-3 128k) uses its long RoPE factors when this exceeds its original context")
    max_num_seqs: int = option(128, "most requests running at once")
    max_num_batched_tokens: int = option(1024, "token budget of one engine step (prefill chunks + decodes)")
    kv_cache_memory: float = option(
        2.0, "KV pool budget in GiB (CPU; overridden by `num_kv_blocks`)",
        alias=UnitAlias("--kv-cache-memory-bytes", int, "BYTES",
                        "KV pool budget in bytes (vLLM's spelling; overrides --kv-cache-memory)",
                        lambda nbytes: nbytes / 2**30))
    num_kv_blocks: int | None = option(None, "KV pool size in blocks (overrides `kv_cache_memory`)")
    block_size: int = option(16, "tokens per KV block")
    enable_prefix_caching: bool = option(
        True, "reuse the KV blocks of an earlier prompt's prefix (full blocks, by chained hash); hybrid models "
        "keep state checkpoints for it too")
    enable_chunked_prefill: bool = option(
        True, "split long prompts across steps under `max_num_batched_tokens`")
    scheduling_policy: str = option(
        "fcfs", "fcfs: requests run in arrival order; priority: by each request's `priority` field (lower "
        "first, ties by arrival), preempting lower-priority running requests for higher ones (docs/scheduling.md)",
        choices=("fcfs", "priority"))
    seed: int = option(0, "seed of the engine's global RNG, which draws for requests without a sampling seed")
    num_threads: int | None = option(None, "torch CPU threads (default: the CPUs this process may use)")
    deterministic: bool = option(
        False, "batch-invariant mode: a request's tokens and log-probabilities are bit-identical whatever else "
        "runs with it (docs/deterministic.md)")
    kv_offload_memory: float = option(
        0.0, "host-RAM KV tier below the pool, in GiB (0: off); evicted prefix blocks go there")
    kv_offload_disk_path: str | os.PathLike | None = option(
        None, "directory of the disk KV tier (default: off); reused after a restart of the same model")
    kv_offload_disk_size: float | None = option(
        None, "most GiB the disk KV tier keeps (default: 16); needs `kv_offload_disk_path`")
    kv_offload_disk_drive_size: float | None = option(
        None, "GiB of the drive under the disk tier, for the DWPD estimate (default: the tier size)")
    kv_cache_dtype: str = option(
        "auto", "KV cache storage: auto (the model's dtype), or int8 / fp8_e4m3 (fp8) with a scale per token and "
        "KV head: about twice the tokens of bf16 in the same memory (docs/kv_cache_dtype.md)",
        choices=("auto", "int8", "fp8_e4m3", "fp8"))
    state_checkpoint_interval: int = option(
        8, "hybrid linear-attention models: keep the linear layers' state every this many blocks for prefix "
        "caching; a prefix hit resumes from the latest one (docs/hybrid_models.md)", metavar="BLOCKS")
    state_cache_memory: float | None = option(
        None, "hybrid linear-attention models: GiB for the state pool (up to `max_num_seqs` live slots, the rest "
        "prefix-cache checkpoints; default: `max_num_seqs` of each)", metavar="GIB")
    session_kv_ttl: float = option(
        0.0, "seconds an agent session's cached KV blocks (requests with an X-Session-Id header or `user` field) "
        "stay ahead of plain LRU eviction between turns; moved to a lower KV tier, not dropped, when the pool "
        "needs them anyway (0: off; docs/kv_offload.md)", metavar="SECONDS")
    device: str = option("auto", "auto (CUDA when available, else CPU), cpu, cuda or cuda:N")
    gpu_memory_utilization: float = option(
        0.9, "CUDA: fraction of device memory for weights + activations + KV cache (the KV pool gets what a "
        "profiling forward leaves)")
    enforce_eager: bool = option(False, "CUDA: run decode steps without CUDA graphs")
    cpu_kernels: bool = option(
        True, "CPU: the compiled C kernels where they beat torch on this machine (measured once per machine) "
        "are on by default; turned off, every layer runs on torch's ops", flag="--no-cpu-kernels")
    structured_outputs_config: "dict | str | StructuredOutputsConfig | None" = option(
        None, "constrained decoding backend: auto (= guidance, llguidance), guidance or xgrammar",
        json=True, example='{"backend": "xgrammar"}')
    enable_lora: bool = option(False, "serve PEFT LoRA adapters, many in one batch (CPU, and CUDA through Triton)")
    max_loras: int = option(1, "adapter slots: the most distinct adapters in one step (others wait their turn)")
    max_lora_rank: int = option(16, "largest adapter rank accepted (slot weights are padded to it)")
    max_cpu_loras: int | None = option(None, "adapters kept loaded in host memory, LRU (default: `max_loras`)")
    kv_events_config: "dict | str | KVEventsConfig | None" = option(
        None, "publish KV cache events for a KV-aware router, vLLM's fields (docs/kv_events.md)",
        json=True, example='{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}')
    speculative_config: "dict | str | SpeculativeConfig | None" = option(
        None, "speculative decoding, vLLM's fields; outputs are unchanged (docs/spec_decode.md)",
        json=True, example='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    kv_transfer_config: "dict | str | KVTransferConfig | None" = option(
        None, "prefill/decode disaggregation: kv_producer on a prefill worker, kv_consumer on a decode worker; "
        "kv_transfer_params and transfers are authenticated with the cluster secret "
        "(kv_connector_extra_config.secret_file; docs/pd_disaggregation.md)", json=True,
        example='{"kv_role": "kv_producer"}')

    # ---- building the engine's config --------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """The frozen ``EngineConfig`` of these options, without loading anything.

        Raises:
            ConfigError (a ValueError): an option out of range or inconsistent with another, naming it.
        """
        from tokenmill.kv_transfer.config import kv_transfer_config
        from tokenmill.spec_decode.config import SpeculativeConfig

        check_bool("enable_lora", self.enable_lora)
        disk_path = self.kv_offload_disk_path  # a str or PathLike; anything else is left for CacheConfig to refuse
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            seed=self.seed,
            num_threads=self.num_threads,
            deterministic=self.deterministic,
            device=self.device,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            cpu_kernels=self.cpu_kernels,
            structured_outputs_config=StructuredOutputsConfig.from_value(self.structured_outputs_config),
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None,
            kv_events_config=KVEventsConfig.from_value(self.kv_events_config),
            speculative_config=SpeculativeConfig.from_value(self.speculative_config),
            quantization=self.quantization,
            kv_transfer_config=kv_transfer_config(self.kv_transfer_config),
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_gib=self.kv_cache_memory,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_offload_memory_gib=self.kv_offload_memory,
                kv_offload_disk_path=os.fspath(disk_path) if isinstance(disk_path, os.PathLike) else disk_path,
                kv_offload_disk_size_gib=self.kv_offload_disk_size,
                kv_offload_disk_drive_size_gib=self.kv_offload_disk_drive_size,
                kv_cache_dtype=self.kv_cache_dtype,
                state_checkpoint_interval=self.state_checkpoint_interval,
                state_cache_memory_gib=self.state_cache_memory,
                session_kv_ttl=self.session_kv_ttl,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                policy=self.scheduling_policy,
            ),
        )

    # ---- Python keywords ---------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, caller: str, kwargs: dict[str, Any]) -> "EngineArgs":
        """The options given as ``caller``'s keyword arguments.

        Raises:
            TypeError: an unknown keyword, naming it (and the closest option name).
        """
        unknown = sorted(set(kwargs) - set(OPTION_NAMES))
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], OPTION_NAMES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}{hint} (the engine "
                            f"options are the fields of tokenmill.engine_args.EngineArgs)")
        return cls(**kwargs)

    def kwargs(self) -> dict[str, Any]:
        """The options as ``LLM(**kwargs)`` keyword arguments (shallow: config objects stay as given)."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    # ---- the command line --------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: "argparse.ArgumentParser", *, positional: bool = True,
                     include: typing.Iterable[str] | None = None,
                     overrides: dict[str, dict[str, Any]] | None = None) -> None:
        """Add the option flags (vLLM's spellings) to a subcommand's parser.

        ``positional``: the model may also be the optional positional MODEL (False where the positional
        arguments are prompts). ``include``: only these options (``tokenmill plan``). ``overrides``:
        ``add_argument`` keywords that differ for this subcommand, per option name (plan's KV budget). The
        parsed namespace's ``engine_options`` lists the options added.
        """
        names = OPTION_NAMES if include is None else [n for n in OPTION_NAMES if n in set(include)]
        for name in names:
            _add_option(parser, name, positional, (overrides or {}).get(name, {}))
        parser.set_defaults(engine_options=tuple(names))

    @classmethod
    def from_cli_args(cls, args: "argparse.Namespace") -> "EngineArgs":
        """The options of a namespace parsed with ``add_cli_args`` (every option included)."""
        return cls(**cli_values(args, OPTION_NAMES))


_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(EngineArgs)}
OPTION_NAMES: tuple[str, ...] = tuple(_FIELDS)


def cli_spelling(name: str) -> CliSpelling:
    """How option ``name`` is typed on the command line."""
    return _FIELDS[name].metadata["cli"]


def cli_flag(name: str) -> str:
    """The flag that sets option ``name`` away from its default (``--no-enable-prefix-caching`` for a switch
    that is on); for names that are not options, ``--`` + the name with dashes (plan's ``--memory``)."""
    dashed = "--" + name.replace("_", "-")
    if name not in _FIELDS:
        return dashed
    spelling = cli_spelling(name)
    if getattr(EngineArgs, name) is True and spelling.flag is None:
        return "--no-" + name.replace("_", "-")
    return spelling.flag or dashed


def render_help(text: str, cli: bool) -> str:
    """A help text with each `name` spelled as its flag (``cli``) or as the ``LLM`` keyword."""
    return _NAME.sub(lambda m: cli_flag(m[1]) if cli else m[1], text)


def _option_type(name: str) -> type:
    """int, float or str: the non-None member of the option's annotation (JSON options are text)."""
    annotation = _FIELDS[name].type
    if isinstance(annotation, str):  # the JSON options name config classes this module does not import
        return str
    members = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return members[0]


def _add_option(parser: "argparse.ArgumentParser", name: str, positional: bool, override: dict[str, Any]) -> None:
    spelling, default = cli_spelling(name), getattr(EngineArgs, name)
    help_text = render_help(_FIELDS[name].metadata["help"], cli=True)
    if spelling.example is not None:
        help_text += f", e.g. '{spelling.example}'"
    kwargs: dict[str, Any] = {"default": default, "help": help_text.replace("%", "%%")}
    if spelling.positional:
        if positional:
            parser.add_argument(name, nargs="?", **{**kwargs, **override})
            kwargs["help"] = "same as the positional MODEL"
        # ``--model`` beside a positional MODEL: main() and from_cli_args merge the two
        parser.add_argument(spelling.flag, dest=f"{name}_flag", metavar=name.upper(), **{**kwargs, **override})
        return
    flags = [spelling.flag or "--" + name.replace("_", "-")]
    if isinstance(default, bool) and default and flags[0].startswith("--no-"):
        kwargs["action"] = "store_false"  # only the --no- form (``--no-cpu-kernels``)
    elif isinstance(default, bool) and default:
        kwargs["action"] = argparse.BooleanOptionalAction  # --enable-X / --no-enable-X as in vLLM
    elif isinstance(default, bool):
        kwargs["action"] = "store_true"
    else:
        kwargs["type"] = _option_type(name)
        if spelling.choices is not None:
            kwargs["choices"] = spelling.choices
        if spelling.metavar is not None or spelling.json:
            kwargs["metavar"] = spelling.metavar or "JSON"
    parser.add_argument(*flags, dest=name, **{**kwargs, **override})
    if spelling.alias is not None:
        alias = spelling.alias
        parser.add_argument(alias.flag, dest=_alias_dest(alias), type=alias.type, default=None,
                            metavar=alias.metavar, help=alias.help)


def _alias_dest(alias: UnitAlias) -> str:
    return alias.flag.removeprefix("--").replace("-", "_")


def cli_values(args: "argparse.Namespace", names: typing.Iterable[str]) -> dict[str, Any]:
    """``{option: value}`` for ``names`` from a namespace parsed with ``add_cli_args``: ``--model`` and the
    positional MODEL merged, a unit alias (``--kv-cache-memory-bytes``) converted and preferred."""
    values = {}
    for name in names:
        spelling = cli_spelling(name)
        value = getattr(args, name, None)
        if spelling.positional:
            value = getattr(args, f"{name}_flag", None) or value
        if spelling.alias is not None and getattr(args, _alias_dest(spelling.alias), None) is not None:
            value = spelling.alias.to_option(getattr(args, _alias_dest(spelling.alias)))
        values[name] = value
    return values


def options_doc(indent: str = "    ") -> str:
    """The options as a docstring ``Args:`` block (``LLM``'s): name, default and help of each field."""
    import textwrap

    lines = []
    for name in OPTION_NAMES:
        spelling = cli_spelling(name)
        text = render_help(_FIELDS[name].metadata["help"], cli=False)
        if spelling.example is not None:
            text += f"; a dict, a config object or JSON text such as ``{spelling.example}``"
        lines += textwrap.wrap(f"{name} (default {getattr(EngineArgs, name)!r}): {text}.", width=110,
                               initial_indent=indent, subsequent_indent=indent + "    ", break_on_hyphens=False)
    return "\n".join(lines)


def with_options_signature(init: Callable) -> Callable:
    """Decorator for ``__init__(self, model=None, **kwargs)`` taking ``EngineArgs``: its signature becomes the
    options (model positional, the rest keyword-only with their defaults), so help() and IDEs show them."""
    import inspect

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(EngineArgs):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=f.type))
    init.__signature__ = inspect.Signature(params, return_annotation=None)
    return init


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
