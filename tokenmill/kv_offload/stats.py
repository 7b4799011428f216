"""Per-tier counters of the lower KV tiers and the disk endurance estimate. Pure Python."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

SECONDS_PER_DAY = 86400.0
# The rate is averaged over at least this long, so the burst of writes that fills an empty tier in
# the first minutes after a start is not projected over a whole day.
MIN_RATE_WINDOW_S = 3600.0

# Faults a lower tier survives (label ``kind`` of tokenmill:kv_offload_errors_total):
# enospc: a write found no room (ENOSPC, EDQUOT, EFBIG); readonly: the directory refused a write (EROFS, EACCES,
# EPERM); corrupt: a record failed its checks (checksum, header, length) at startup or on read; io: any other
# I/O error; alloc: the RAM tier's slab could not be allocated.
FAULT_KINDS = ("enospc", "readonly", "corrupt", "io", "alloc")


@dataclass
class TierStats:
    """Cumulative counters of one tier (mutated by the tier that owns it; ints, so readers on other
    threads see whole values).

    ``hits`` counts blocks this tier served back to the primary pool; ``evictions`` counts blocks
    it dropped or handed down for lack of room. ``enabled`` is 1 while the tier takes new blocks and 0 once a
    fault switched it off; ``errors`` counts faults by kind (``FAULT_KINDS``).
    """

    capacity_blocks: int = 0
    blocks_stored: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    hits: int = 0
    evictions: int = 0
    enabled: int = 1
    errors: dict[str, int] = field(default_factory=dict)  # fault kind -> occurrences

    def as_dict(self) -> dict:
        """Every counter; ``errors`` as its own dict (a copy)."""
        return asdict(self)


def drive_writes_per_day(
    bytes_written: int, elapsed_s: float, drive_bytes: int, min_window_s: float = MIN_RATE_WINDOW_S
) -> float:
    """Drive writes per day at the average rate since start: bytes per day ÷ drive size.

    The rate is ``bytes_written`` over ``max(elapsed_s, min_window_s)`` seconds: by default, during
    the first hour it is a lower bound that grows to the true average, instead of a startup burst
    extrapolated to a day (a benchmark of a fixed workload passes ``min_window_s=0`` for its rate).
    A drive rated for N DWPD over its warranty wears out on schedule when this stays ≤ N.
    """
    if drive_bytes <= 0:
        return 0.0
    if elapsed_s <= 0 and min_window_s <= 0:
        return 0.0
    return bytes_written / max(elapsed_s, min_window_s) * SECONDS_PER_DAY / drive_bytes
