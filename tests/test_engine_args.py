"""Every engine option is written once, in ``EngineArgs``, and reaches every interface from there: ``LLM(...)``'s
signature and docstring, the engine config, the flags of each subcommand that builds an engine (same
defaults; plan's subset), ``ServerConfig``, ``PlanConfig`` and the CLI spelling of errors. Every test is
parametrized by ``dataclasses.fields(EngineArgs)``, so a new field is checked everywhere without editing this
file. No weights are loaded: ``LLM`` runs over a stub engine."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.cli.main import build_parser
from tokenmill.cli.plan import PLAN_OPTIONS
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine_args import OPTION_NAMES, EngineArgs, _option_type, cli_flag, cli_spelling, cli_values
from tokenmill.memory_plan import PlanConfig

REPO = Path(__file__).resolve().parents[1]
DEFAULTS = EngineArgs()


def candidates(name: str, reference: object) -> list:
    """Values of option ``name`` other than ``reference``, from its type alone (no per-option list)."""
    spelling = cli_spelling(name)
    default = getattr(EngineArgs, name)
    if spelling.example is not None:
        return [spelling.example]
    if isinstance(default, bool):
        return [not reference]
    if spelling.choices is not None:
        return [c for c in spelling.choices if c != reference]
    kind = _option_type(name)
    if kind is int:
        values = [2 * (reference or 2), 1]
    elif kind is float:
        values = [(reference or 1.0) / 2, 0.5]
    else:
        values = ["cpu", "other-dir"]
    return [v for v in values if v != reference]


@pytest.fixture(scope="module")
def contexts(tmp_path_factory) -> list[EngineArgs]:
    """The defaults, then settings under which dependent options matter (LoRA on, a disk KV tier)."""
    return [DEFAULTS, EngineArgs(enable_lora=True, kv_offload_disk_path=str(tmp_path_factory.mktemp("disk_tier")))]


def changed_setting(name: str, contexts: list[EngineArgs]) -> tuple[EngineArgs, object, EngineConfig]:
    """A context and a value of ``name`` that the config builder accepts and that changes the config."""
    for context in contexts:
        base = context.create_engine_config()
        for value in candidates(name, getattr(context, name)):
            try:
                config = dataclasses.replace(context, **{name: value}).create_engine_config()
            except ConfigError:
                continue
            if config != base:
                return context, value, config
    pytest.fail(f"no value of {name!r} changes the engine config: create_engine_config() does not use it")


def engine_subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand (``bench offline`` spelled with its parent) given engine options by ``add_cli_args``."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        if parser.get_default("engine_options") is not None:
            found[" ".join(path)] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
    walk(build_parser(), [])
    return found


SUBCOMMANDS = engine_subcommands()
PROMPT = {"generate": ["a prompt"]}  # positional arguments a subcommand needs


def parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([*command.split(), *PROMPT.get(command, []), *argv])


def test_the_subcommands_that_build_an_engine_all_take_engine_options():
    assert set(SUBCOMMANDS) == {"generate", "chat", "serve", "bench offline", "bench compare", "plan"}
    assert all(parse(c).engine_options == OPTION_NAMES for c in SUBCOMMANDS if c != "plan")
    assert set(parse("plan").engine_options) == {"model", *PLAN_OPTIONS}


# ---- LLM ------------------------------------------------------------------------------------------
def test_llm_signature_and_docstring_are_the_options():
    from tokenmill import LLM

    params = inspect.signature(LLM).parameters
    assert tuple(params) == OPTION_NAMES
    assert {n: p.default for n, p in params.items()} == DEFAULTS.kwargs()
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for n, p in params.items() if n != "model")
    for name in OPTION_NAMES:
        assert re.search(rf"^ +{name} \(default ", LLM.__doc__, re.MULTILINE), name


@pytest.fixture
def stub_engine(monkeypatch) -> list[EngineConfig]:
    """``LLM`` over an engine that records its config instead of loading a model."""
    import tokenmill.engine.llm as llm_module

    configs: list[EngineConfig] = []

    class StubEngine:
        def __init__(self, config: EngineConfig) -> None:
            configs.append(config)

        def get_tokenizer(self):
            return None

    monkeypatch.setattr(llm_module, "LLMEngine", StubEngine)
    monkeypatch.setattr(llm_module, "ChatPromptRenderer", lambda tokenizer: None)
    return configs


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_option_reaches_the_engine_config_through_llm(name, contexts, stub_engine):
    from tokenmill import LLM

    context, value, expected = changed_setting(name, contexts)
    LLM(**{**context.kwargs(), name: value})
    LLM.from_engine_args(dataclasses.replace(context, **{name: value}))
    assert stub_engine == [expected, expected]


def test_unknown_keyword_is_a_type_error_naming_it(stub_engine):
    from tokenmill import LLM
    from tokenmill.engine.llm import build_engine_config

    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'max_num_seq'; did you mean "
                                        r"'max_num_seqs'\?"):
        LLM(max_num_seq=4)
    with pytest.raises(TypeError, match="'kv_cache_gib'"):
        build_engine_config(kv_cache_gib=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        EngineArgs(bogus=1)
    assert stub_engine == []


def test_default_options_build_the_default_engine_config():
    # EngineConfig and its parts keep defaults for direct construction; they must be EngineArgs'.
    assert DEFAULTS.create_engine_config() == EngineConfig()


# ---- command line ---------------------------------------------------------------------------------
def cli_argv(name: str, value: object) -> list[str]:
    """The flags that set option ``name`` to ``value`` (a switch: the flag that turns it away from its default)."""
    if isinstance(value, bool):
        return [cli_flag(name)]
    return [cli_spelling(name).flag or "--" + name.replace("_", "-"), str(value)]


@pytest.mark.parametrize("command", sorted(set(SUBCOMMANDS) - {"plan"}))
def test_engine_subcommand_has_every_option_with_its_default(command):
    assert EngineArgs.from_cli_args(parse(command)) == DEFAULTS
    dests = {a.dest for a in SUBCOMMANDS[command]._actions}
    assert set(OPTION_NAMES) - {"model"} <= dests and "model_flag" in dests


@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("command", sorted(set(SUBCOMMANDS) - {"plan"}))
def test_option_flag_sets_the_option(command, name):
    value = candidates(name, getattr(DEFAULTS, name))[0]
    assert getattr(EngineArgs.from_cli_args(parse(command, *cli_argv(name, value))), name) == value


def test_positional_model_and_model_flag_are_the_same_option():
    assert EngineArgs.from_cli_args(parse("serve", "m")).model == "m"
    assert EngineArgs.from_cli_args(parse("serve", "--model", "m")).model == "m"
    assert EngineArgs.from_cli_args(parse("plan", "m")).model == "m"


def test_plan_takes_its_options_with_the_engine_defaults():
    assert set(PLAN_OPTIONS) >= {"dtype", "block_size", "max_num_seqs", "kv_cache_memory", "state_cache_memory"}
    parsed = cli_values(parse("plan"), PLAN_OPTIONS)
    defaults = {f.name: f.default for f in dataclasses.fields(PlanConfig) if f.name in PLAN_OPTIONS}
    assert parsed == defaults
    # The plan's only own default: no KV budget means "what --memory leaves".
    assert {n for n in PLAN_OPTIONS if defaults[n] != getattr(DEFAULTS, n)} == {"kv_cache_memory"}
    for name in PLAN_OPTIONS:
        value = candidates(name, defaults[name])[0]
        assert cli_values(parse("plan", *cli_argv(name, value)), [name]) == {name: value}


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_config_errors_name_the_flag_the_parser_has(name):
    flags = {s for a in SUBCOMMANDS["serve"]._actions for s in a.option_strings}
    assert cli_flag(name) in flags
    assert ConfigError(f"`{name}` is wrong").for_cli() == f"{cli_flag(name)} is wrong"
    assert str(ConfigError(f"`{name}` is wrong")) == f"{name} is wrong"


# ---- the consumers restate nothing ----------------------------------------------------------------
def test_no_consumer_restates_an_option():
    flags = {cli_flag(n) for n in OPTION_NAMES} | {"--" + n.replace("_", "-") for n in OPTION_NAMES}
    flags |= {cli_spelling(n).alias.flag for n in OPTION_NAMES if cli_spelling(n).alias is not None}
    flag_pattern = re.compile(r"""add_argument\(\s*["'](%s|model)["']""" % "|".join(map(re.escape, flags)))
    # `bench serve --model` is the client's served model name (also `--served-model-name`), not an engine option.
    client_model = 'serve.add_argument("--model", "--served-model-name"'
    for name in ("main.py", "serve.py", "plan.py", "bench.py"):
        text = (REPO / "tokenmill" / "cli" / name).read_text().replace(client_model, "")
        assert not flag_pattern.search(text), f"cli/{name} adds an engine flag itself"
    get_default = re.compile(r"""\.get\(\s*["'](%s)["']\s*,""" % "|".join(OPTION_NAMES))
    for path in (REPO / "tokenmill").rglob("*.py"):
        assert not get_default.search(path.read_text()), f"{path} restates an option's default"


def test_llm_and_the_config_builder_take_the_options_as_keywords():
    tree = ast.parse((REPO / "tokenmill" / "engine" / "llm.py").read_text())
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    init = functions["__init__"].args
    assert [a.arg for a in init.args] == ["self", "model"] and init.kwarg is not None and not init.kwonlyargs
    assert not functions["build_engine_config"].args.args and not functions["build_engine_config"].args.kwonlyargs


def test_plan_config_takes_the_engine_defaults_from_engine_args():
    tree = ast.parse((REPO / "tokenmill" / "memory_plan.py").read_text())
    plan = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "PlanConfig")
    for stmt in plan.body:
        if isinstance(stmt, ast.AnnAssign) and stmt.target.id in OPTION_NAMES and stmt.target.id != "kv_cache_memory":
            assert ast.unparse(stmt.value) == f"EngineArgs.{stmt.target.id}", ast.unparse(stmt)
    annotations = {f.name: f.type for f in dataclasses.fields(PlanConfig)}  # text: memory_plan's are postponed
    for field in dataclasses.fields(EngineArgs):
        if field.name in PLAN_OPTIONS and field.name != "kv_cache_memory":
            assert annotations[field.name] == inspect.formatannotation(field.type), field.name


def test_server_config_holds_engine_args():
    from tokenmill.cli.replicas import replica_config
    from tokenmill.server.state import ServerConfig

    fields = {f.name: f for f in dataclasses.fields(ServerConfig)}
    assert not set(fields) & set(OPTION_NAMES)
    assert ServerConfig(served_model_name="m").engine_args == DEFAULTS
    replica = replica_config(ServerConfig("m", engine_args=EngineArgs(max_num_seqs=4)), port=1, num_threads=2)
    assert replica.engine_args == EngineArgs(max_num_seqs=4, num_threads=2)


def test_engine_args_import_nothing_heavy():
    # The router process imports the CLI, which imports engine_args: no torch, numpy or engine package.
    code = ("import sys, tokenmill.engine_args; print(sorted({'torch', 'numpy', 'transformers', 'tokenmill.engine', "
            "'tokenmill.server'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
