"""Test-session report: which CPU this is, which ISA paths it can run, and which kernel builds ran.

The suite must pass on every CPU of the pool (AVX-512 machines and AVX2-only ones), so the header
says which kind this run had and the summary lists the (kernel, ISA path) builds the tests loaded.

Every engine of the suite, in this process and in the servers it starts, checks its KV pool each time it
goes idle (TOKENMILL_CHECK_INTEGRITY=1: every block and state slot free again, the indexes consistent), so
a leak anywhere fails the test that caused it.
"""
from __future__ import annotations

import os
import platform

import pytest

os.environ.setdefault("TOKENMILL_CHECK_INTEGRITY", "1")
# The per-user cluster secret (tokenmill.security) of this test session lives in a private directory, not in the
# home of whoever runs the suite; the servers the tests start inherit it.
if "TOKENMILL_TEST_CONFIG_HOME" not in os.environ:
    import tempfile

    os.environ["TOKENMILL_TEST_CONFIG_HOME"] = os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="tokenmill-cfg-")


@pytest.fixture(scope="session")
def hf_smollm2(tmp_path_factory):
    """transformers' float32 SmolLM2, read by transformers itself from the embedded GGUF (the reference
    of the equality tests); tests must not modify it. Parsing the GGUF takes transformers 15-40 s, so the first
    pytest-xdist worker of a run to need it saves what it built (config and float32 weights, safetensors) in the
    run's shared temporary directory and the other workers load that (about 2 s): the same bits."""
    import fcntl

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenmill.models.default_model import default_model_path

    path = default_model_path()
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: nobody to share it with
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    share = tmp_path_factory.getbasetemp().parent / "hf_smollm2"  # pytest-N/, beside each worker's popen-gwK/
    share.mkdir(exist_ok=True)
    weights = share / "model.safetensors"
    with open(share / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other workers wait while the first one parses the GGUF
        if weights.exists():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(share)), dtype=torch.float32)
            missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
            model.tie_weights()
            return model.eval()
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        state = model.state_dict()
        tied = state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        save_file({k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")},
                  share / "model.tmp")
        model.config.to_json_file(share / "config.json")
        (share / "model.tmp").rename(weights)
        return model


def pytest_report_header(config) -> list[str]:
    from tokenmill import csrc_build

    return [
        f"tokenmill CPU: {csrc_build.cpu_model_name()} ({platform.machine()}); ISA paths this CPU runs: "
        f"{', '.join(csrc_build.supported_isas())}; default path: {csrc_build.selected_isa()}",
    ]


# Kernel builds that pytest-xdist workers loaded (scripts/test.sh runs one per core); the controller
# process loads none itself, so each worker sends its set when it finishes.
_WORKER_KERNELS: set[tuple[str, str]] = set()


def pytest_sessionfinish(session, exitstatus) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the set to the controller
        from tokenmill import csrc_build

        workeroutput["tokenmill_loaded_kernels"] = sorted(csrc_build.loaded_kernels)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without the plugin
def pytest_testnodedown(node, error) -> None:
    _WORKER_KERNELS.update(tuple(k) for k in getattr(node, "workeroutput", {}).get("tokenmill_loaded_kernels", ()))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    from tokenmill import csrc_build

    by_isa: dict[str, list[str]] = {}
    for stem, isa in sorted(set(csrc_build.loaded_kernels) | _WORKER_KERNELS):
        by_isa.setdefault(isa, []).append(stem)
    terminalreporter.write_sep("-", "C kernel ISA paths exercised in this run")
    terminalreporter.write_line(pytest_report_header(config)[0])
    for isa in csrc_build.ISAS:
        if isa in by_isa:
            terminalreporter.write_line(f"{isa}: {', '.join(by_isa[isa])}")
        else:
            reason = "not run by any test" if csrc_build.isa_supported(isa) else (
                f"skipped, this needs {', '.join(csrc_build.missing_cpu_flags(isa))}")
            terminalreporter.write_line(f"{isa}: {reason}")
