"""The one line `chat` and `generate` print to stderr once the engine is ready: model, dtype, device,
CPU ISA path and kernel choice, so a user can see why speed differs between machines.
Reads the engine; changes nothing.
"""
from __future__ import annotations

from pathlib import Path


def cpu_isa() -> str:
    """The ISA path the C kernels are built for (``tokenmill.csrc_build.selected_isa``), or "unknown"."""
    from tokenmill import csrc_build

    selected_isa = getattr(csrc_build, "selected_isa", None)
    return selected_isa() if selected_isa is not None else "unknown"


def kernel_choice(engine) -> str:
    """The runner's own description of its kernels (``runner.kernel_choice``) when it has one, else a
    summary from the settings: batch-invariant, CUDA, torch (C kernels off) or the C kernels loaded."""
    choice = getattr(engine.runner, "kernel_choice", None)
    if choice:
        return choice
    from tokenmill import csrc_build

    if engine.config.deterministic:
        return "batch-invariant kernels"
    if engine.device.type != "cpu":
        return "CUDA, eager" if engine.config.enforce_eager else "CUDA, CUDA graphs for decode"
    if csrc_build.kernels_disabled():
        return "torch (TOKENMILL_DISABLE_CPU_KERNELS=1)"
    loaded = sorted({stem for stem, _isa in getattr(csrc_build, "loaded_kernels", ())})
    return "C kernels: " + ", ".join(loaded) if loaded else "C kernels where they build, torch elsewhere"


def startup_line(engine) -> str:
    """``tokenmill: <model>, <dtype> on <device>, ISA <path>, kernels: <choice>`` for an ``LLMEngine``."""
    dtype = str(engine.loaded.dtype).removeprefix("torch.")
    isa = f", ISA {cpu_isa()}" if engine.device.type == "cpu" else ""
    return (f"tokenmill: {Path(engine.loaded.model_path).name}, {dtype} on {engine.device}{isa}, "
            f"kernels: {kernel_choice(engine)}")
