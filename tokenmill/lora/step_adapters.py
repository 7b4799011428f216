"""StepAdapters: the scheduler's LoRA hook, at most ``max_loras`` distinct adapters in one step.

Pure Python bookkeeping (never imports torch). Running requests enter first (their adapters always
fit: every adapter of a running request was admitted under this limit); then each waiting request
asks ``fits`` and, once scheduled, is ``add``ed. A waiting request whose adapter finds no free
place is skipped, and from then on this step admits only base-model requests: letting later
requests of resident adapters in would keep those slots busy and could starve the skipped one, so
adapters are served first come, first served.
"""
from __future__ import annotations

from collections.abc import Iterable

from tokenmill.request import Request


class StepAdapters:
    """The distinct adapters of the step being planned.

    Args:
        max_loras: most distinct adapters per step (None: no limit, LoRA disabled).
        running: requests already scheduled this step (their adapters are counted).
    """

    def __init__(self, max_loras: int | None, running: Iterable[Request] = ()) -> None:
        self.max_loras = max_loras
        self.lora_ids = {r.lora_int_id for r in running if r.lora_int_id is not None}
        assert max_loras is None or len(self.lora_ids) <= max_loras, f"running requests use {self.lora_ids}"
        self.blocked = False  # a waiting request was skipped for want of a slot

    def fits(self, request: Request) -> bool:
        """Whether ``request`` may join this step; False means skip it (and block later adapter requests)."""
        lora_id = request.lora_int_id
        if lora_id is None or self.max_loras is None:
            return True
        if not self.blocked and (lora_id in self.lora_ids or len(self.lora_ids) < self.max_loras):
            return True
        self.blocked = True
        return False

    def add(self, request: Request) -> None:
        """Count the adapter of a request just scheduled (after ``fits`` said yes)."""
        if request.lora_int_id is not None:
            self.lora_ids.add(request.lora_int_id)
