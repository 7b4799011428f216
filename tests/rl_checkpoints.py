"""Checkpoints for the RL weight-update tests: perturbed and broken copies of a tiny model, and
transformers references (log-probabilities of a prompt, greedy continuations) for any of them."""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def perturbed_copy(src: Path, dst: Path, scale: float = 0.05, seed: int = 1, drop: tuple[str, ...] = (),
                   reshape: dict[str, tuple[int, ...]] | None = None) -> Path:
    """Copy the model directory ``src`` to ``dst`` with every weight plus ``scale`` x N(0, 1) noise;
    ``drop`` leaves tensors out and ``reshape`` replaces tensors by zeros of another shape (broken
    checkpoints). Returns ``dst``."""
    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    new = {name: w + scale * torch.randn(w.shape, generator=generator, dtype=w.dtype)
           for name, w in weights.items() if name not in drop}
    for name, shape in (reshape or {}).items():
        new[name] = torch.zeros(shape)
    save_file(new, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@contextlib.contextmanager
def _one_thread():
    """torch on one thread (a tiny model on a busy 2-core box runs several times faster so)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Reference:
    """A transformers model loaded from a checkpoint directory (float32, eval); computed on one thread."""

    def __init__(self, path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    @torch.no_grad()
    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens before it) for i >= 1."""
        with _one_thread():
            logits = self.model(torch.tensor([token_ids])).logits[0].float()  # (T, vocab)
        logprobs = torch.log_softmax(logits, dim=-1)
        return [logprobs[i - 1, token_ids[i]].item() for i in range(1, len(token_ids))]

    @torch.no_grad()
    def greedy(self, token_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation (stops at EOS, as the server does)."""
        with _one_thread():
            out = self.model.generate(torch.tensor([token_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                      attention_mask=torch.ones(1, len(token_ids), dtype=torch.long))
        return out[0, len(token_ids):].tolist()
