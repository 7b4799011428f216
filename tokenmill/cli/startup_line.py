"""The one line `chat` and `generate` print to stderr once the engine is ready: model, dtype, device,
CPU ISA path and kernel choice, so a user can see why speed differs between machines, and on CPU the
OpenMP spin count tokenmill set at import (runner/cpu_threads.py), if it did.
Reads the engine; changes nothing.
"""
from __future__ import annotations

from pathlib import Path


def startup_line(engine) -> str:
    """``tokenmill: <model>, <dtype> on <device>, ISA <path>, kernels: <choice>[; <OpenMP note>]`` for an
    ``LLMEngine``."""
    from tokenmill import csrc_build
    from tokenmill.runner.cpu_threads import omp_spin_note

    dtype = str(engine.loaded.dtype).removeprefix("torch.")
    if getattr(engine.loaded, "quantization", "none") != "none":
        dtype += f" activations, {engine.loaded.quantization} weights"
    isa = f", ISA {csrc_build.selected_isa()}" if engine.device.type == "cpu" else ""
    note = omp_spin_note() if engine.device.type == "cpu" else None
    return (f"tokenmill: {Path(engine.loaded.model_path).name}, {dtype} on {engine.device}{isa}, "
            f"kernels: {engine.runner.kernel_choice}" + (f"; {note}" if note else ""))
