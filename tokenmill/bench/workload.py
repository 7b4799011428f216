"""Benchmark workloads: dataset flags, the client tokenizer, and building the list of conversations.

Every dataset becomes a list of ``Conversation``s; single-turn datasets (sharegpt, random,
shared-prefix) give one-turn conversations, ``multi-turn`` gives several turns each. Shared by
``bench serve`` (over HTTP) and ``bench offline``/``compare`` (in-process). Never imports torch.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.conversations import sample_conversations
from tokenmill.bench.datasets import SampledRequest, sample_random, sample_sharegpt
from tokenmill.bench.synthetic import sample_shared_prefix

DATASETS = ("sharegpt", "random", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class Conversation:
    """Turns sent in order, each after the previous answer arrived (one turn for single-turn datasets)."""

    turns: tuple[SampledRequest, ...]

    @property
    def is_multi_turn(self) -> bool:
        return len(self.turns) > 1


@dataclass(frozen=True)
class DatasetConfig:
    """Which dataset to sample and its knobs (flag names as in ``add_dataset_args``)."""

    name: str = "sharegpt"
    num_prompts: int = 100
    seed: int = 0
    sharegpt_output_len: int | None = None
    sharegpt_max_prompt_len: int = 1024
    sharegpt_max_total_len: int = 2048
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    shared_prefix_num_groups: int = 4
    shared_prefix_len: int = 512
    shared_prefix_suffix_len: int = 32
    shared_prefix_output_len: int = 128
    multi_turn_num_turns: int = 3
    multi_turn_max_output_len: int = 128
    multi_turn_max_total_len: int = 2048

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset_name must be one of {DATASETS}, got {self.name!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")


def add_dataset_args(parser: argparse.ArgumentParser, with_seed: bool = True) -> None:
    """Dataset flags shared by every ``bench`` subcommand (``with_seed=False`` where the engine flags own ``--seed``)."""
    d = DatasetConfig()
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", "--dataset", dest="dataset_name", choices=DATASETS, default=d.name)
    g.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="requests to send (multi-turn: conversations)")
    if with_seed:
        g.add_argument("--seed", type=int, default=d.seed, help="dataset sampling and arrival-time seed")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length (default: each reference reply's length)")
    g.add_argument("--sharegpt-max-prompt-len", type=int, default=d.sharegpt_max_prompt_len)
    g.add_argument("--sharegpt-max-total-len", type=int, default=d.sharegpt_max_total_len)
    g.add_argument("--random-input-len", type=int, default=d.random_input_len)
    g.add_argument("--random-output-len", type=int, default=d.random_output_len)
    g.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    g.add_argument("--shared-prefix-num-groups", type=int, default=d.shared_prefix_num_groups)
    g.add_argument("--shared-prefix-len", type=int, default=d.shared_prefix_len, help="prefix tokens per group")
    g.add_argument("--shared-prefix-suffix-len", type=int, default=d.shared_prefix_suffix_len)
    g.add_argument("--shared-prefix-output-len", type=int, default=d.shared_prefix_output_len)
    g.add_argument("--multi-turn-num-turns", type=int, default=d.multi_turn_num_turns)
    g.add_argument("--multi-turn-max-output-len", type=int, default=d.multi_turn_max_output_len)
    g.add_argument("--multi-turn-max-total-len", type=int, default=d.multi_turn_max_total_len)


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    """The DatasetConfig of parsed ``add_dataset_args`` flags."""
    return DatasetConfig(
        name=args.dataset_name, num_prompts=args.num_prompts, seed=args.seed,
        sharegpt_output_len=args.sharegpt_output_len, sharegpt_max_prompt_len=args.sharegpt_max_prompt_len,
        sharegpt_max_total_len=args.sharegpt_max_total_len, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        shared_prefix_num_groups=args.shared_prefix_num_groups, shared_prefix_len=args.shared_prefix_len,
        shared_prefix_suffix_len=args.shared_prefix_suffix_len, shared_prefix_output_len=args.shared_prefix_output_len,
        multi_turn_num_turns=args.multi_turn_num_turns, multi_turn_max_output_len=args.multi_turn_max_output_len,
        multi_turn_max_total_len=args.multi_turn_max_total_len,
    )


def build_workload(config: DatasetConfig, tokenizer: Any) -> list[Conversation]:
    """Sample ``config.num_prompts`` requests (or conversations) of the configured dataset."""
    c = config
    if c.name == "multi-turn":
        convs = sample_conversations(tokenizer, c.num_prompts, c.multi_turn_num_turns, c.seed,
                                     c.multi_turn_max_output_len, c.multi_turn_max_total_len)
        return [Conversation(turns) for turns in convs]
    if c.name == "sharegpt":
        requests = sample_sharegpt(tokenizer, c.num_prompts, c.seed, max_prompt_len=c.sharegpt_max_prompt_len,
                                   max_total_len=c.sharegpt_max_total_len, fixed_output_len=c.sharegpt_output_len)
    elif c.name == "random":
        requests = sample_random(tokenizer, c.num_prompts, c.random_input_len, c.random_output_len,
                                 c.random_range_ratio, c.seed)
    else:
        requests = sample_shared_prefix(tokenizer, c.num_prompts, c.shared_prefix_num_groups, c.shared_prefix_len,
                                        c.shared_prefix_suffix_len, c.shared_prefix_output_len, c.seed)
    return [Conversation((r,)) for r in requests]


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None) -> Any:
    """An HF tokenizer from a local directory or .gguf file; None: the embedded SmolLM2 GGUF's tokenizer.

    A directory without tokenizer files but with exactly one .gguf file means that file.

    Raises:
        ValueError: ``path`` does not exist (the benchmark never downloads tokenizers).
    """
    from transformers import AutoTokenizer

    if path is None:
        from tokenmill.models.default_model import default_model_path

        file = default_model_path()
    else:
        file = Path(path).expanduser()
        if not file.exists():
            raise ValueError(f"tokenizer {path!r} is not a local path (a model directory or a .gguf file)")
        if file.is_dir() and not (file / "tokenizer.json").is_file() and not (file / "tokenizer_config.json").is_file():
            ggufs = sorted(file.glob("*.gguf"))
            if len(ggufs) == 1:
                file = ggufs[0]
    if file.is_file() and file.suffix == ".gguf":
        # the engine's own GGUF tokenizer: also for architectures transformers' GGUF reader refuses (olmoe,
        # deepseek2), and split as llama.cpp splits the file's pre-tokenizer
        from tokenmill.models.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(file)
    return AutoTokenizer.from_pretrained(str(file))
