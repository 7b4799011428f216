"""The CPU KV cache on transparent huge pages (tokenmill/huge_pages.py): the advice reaches Linux
(the range is marked "hg" in /proc/self/smaps), the tensor is zeroed like
torch.zeros, and the engine's KV cache uses it."""
from __future__ import annotations

import platform
import re
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.huge_pages import advise_huge_pages, is_mapped, release_pages, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed choice of THP's "enabled" setting ("always", "madvise", "never"), None without THP."""
    if not THP.exists():
        return None
    found = re.search(r"\[(\w+)\]", THP.read_text())
    return found.group(1) if found else None


def mapping_field(ptr: int, field: str) -> int:
    """A size field (kB, e.g. "Rss") of the mapping of this process that holds address ``ptr``, in bytes."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= ptr < int(head.group(2), 16)
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {ptr:#x}")


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s own pages that are resident (mincore(2) over exactly its range).

    smaps' "Rss" counts a whole mapping, and Linux merges neighbouring anonymous mappings with the same flags into
    one: another allocation's pages beside the tensor would count as the tensor's.
    """
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page) * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * page


def mapping_vm_flags(ptr: int) -> set[str]:
    """VmFlags of the mapping of this process that holds address ``ptr`` ("hg": advised MADV_HUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= ptr < int(head.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    return set()


def test_zeros_on_huge_pages_is_torch_zeros():
    for shape, dtype in (((3, 5), torch.float32), ((2, 1024, 1024), torch.bfloat16), ((0, 7), torch.int8)):
        t = zeros_on_huge_pages(shape, dtype, torch.device("cpu"))
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() in (None, "never"),
                    reason="needs Linux with transparent huge pages enabled (always or madvise)")
def test_a_large_tensor_is_advised_onto_huge_pages():
    t = zeros_on_huge_pages((48, 1024, 1024), torch.uint8, torch.device("cpu"))  # 48 MiB
    first_huge = -(-t.data_ptr() // (2 << 20)) * (2 << 20)  # the advice splits the mapping there
    # Linux marks the advised range (whether 2 MiB pages were free to back it is up to the kernel)
    assert "hg" in mapping_vm_flags(first_huge), "the tensor's memory was not advised MADV_HUGEPAGE"
    plain = torch.empty(48, 1024, 1024, dtype=torch.uint8)
    inside = -(-plain.data_ptr() // (2 << 20)) * (2 << 20) + (2 << 20)
    assert advise_huge_pages(plain) >= 44 << 20 and "hg" in mapping_vm_flags(inside)
    small = torch.empty(4096, dtype=torch.uint8)
    assert advise_huge_pages(small) == 0  # smaller than one huge page: nothing to advise
    advised = advise_huge_pages(torch.empty(16, 1024, 1024, dtype=torch.uint8))
    assert 14 << 20 <= advised <= 16 << 20  # the whole 2 MiB pages inside 16 MiB


def test_the_engines_cpu_kv_cache_is_advised(tmp_path):
    """ModelRunner's KV pool is a mapping of its own (``zeros_on_huge_pages``), which the idle engine's prefault
    thread advises onto huge pages (VmFlags "hg") and faults in."""
    from tests.tiny_models import make_tiny_model
    from tokenmill import LLM

    llm = LLM(model=str(make_tiny_model("llama", tmp_path)), num_kv_blocks=1024)  # 8 MiB of K/V
    try:
        pool = llm.engine.runner.kv_pool
        assert is_mapped(pool.kv)
        assert llm.generate([[1, 2, 3]])[0].outputs[0].token_ids
        if pool._prefault is not None and thp_mode() == "madvise":
            pool._prefault.thread.join(timeout=60)
            assert "hg" in mapping_vm_flags(pool.kv[:, :, -1].data_ptr())
    finally:
        llm.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
def test_a_large_pool_takes_memory_only_where_written_and_gives_it_back():
    """A 64 MiB tensor is ready untouched (no resident pages: Linux zero-fills them on first write), takes
    memory where written, and release_pages returns it while the tensor stays valid and reads as zeros."""
    t = zeros_on_huge_pages((64, 1024, 1024), torch.uint8, torch.device("cpu"))
    assert is_mapped(t) and t.data_ptr() % (2 << 20) == 0  # on a huge-page boundary
    assert resident_bytes(t) < 4 << 20  # nothing faulted in by the allocation itself
    t[:16].fill_(7)
    assert resident_bytes(t) >= 16 << 20
    assert int(t.sum()) == 7 * (16 << 20)
    assert release_pages(t) >= 64 << 20
    assert resident_bytes(t) < 4 << 20 and not t.any()
    t[3, 5, 7] = 1  # still usable
    assert int(t.sum()) == 1
    assert not is_mapped(torch.zeros(8))
    with pytest.raises(ValueError, match="zeros_on_huge_pages"):
        release_pages(torch.zeros(8))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
def test_prefault_takes_the_pages_without_writing_them():
    """A Prefault thread faults a pool's pages in without touching what the engine writes meanwhile (Linux
    5.14+ MADV_POPULATE_WRITE; on an older kernel the thread ends at once and pages fault on demand)."""
    from tokenmill.huge_pages import Prefault

    t = zeros_on_huge_pages((96, 1024, 1024), torch.uint8, torch.device("cpu"))
    t[50].fill_(3)  # written before and while the thread runs: kept
    prefault = Prefault(t)
    t[90].fill_(5)
    prefault.thread.join(timeout=60)
    assert not prefault.thread.is_alive()
    assert int(t[50].sum()) == 3 << 20 and int(t[90].sum()) == 5 << 20 and int(t.sum()) == 8 << 20
    if tuple(int(x) for x in platform.release().split(".")[:2]) >= (5, 14):
        assert resident_bytes(t) >= 90 << 20  # every page taken, none written by the thread
    stopped = Prefault(zeros_on_huge_pages((64, 1024, 1024), torch.uint8, torch.device("cpu")))
    stopped.stop()
    assert not stopped.thread.is_alive()


@pytest.mark.skipif(not sys.platform.startswith("linux") or tuple(int(x) for x in platform.release().split(".")[:2])
                    < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14+")
def test_prefault_waits_while_the_engine_steps_and_goes_on_when_it_is_idle():
    """Beside running steps the thread would slow them (the memory system backs each page); while steps run (short
    ones back to back, then one longer than ``QUIET_S``) it takes no page, and it finishes once the engine has been
    idle for ``QUIET_S``."""
    import time

    from tokenmill.huge_pages import Prefault

    t = zeros_on_huge_pages((64, 1024, 1024), torch.uint8, torch.device("cpu"))
    prefault = Prefault(t, start_busy=True)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # an engine stepping every 10 ms
        prefault.step_started()
        time.sleep(0.01)
        prefault.step_ended()
    prefault.step_started()  # one long step: 3 x QUIET_S
    time.sleep(3 * Prefault.QUIET_S)
    assert resident_bytes(t) < 4 << 20  # nothing taken while busy
    prefault.step_ended()
    prefault.thread.join(timeout=60)
    assert not prefault.thread.is_alive()
    assert resident_bytes(t) >= 62 << 20  # idle: every page taken


@pytest.mark.skipif(thp_mode() != "madvise" or tuple(int(x) for x in platform.release().split(".")[:2]) < (5, 14),
                    reason="needs THP enabled=madvise and MADV_POPULATE_WRITE (Linux 5.14+)")
def test_an_unadvised_pool_faults_small_pages_in_steps_and_the_idle_prefault_advises_the_rest():
    """The KV pool's mapping (``advise=False``): a first write in a step takes small pages at once (no compaction
    inside the step); the prefault advises each 2 MiB it takes, so the rest of the pool ends on huge pages."""
    from tokenmill.huge_pages import Prefault

    t = zeros_on_huge_pages((64, 1024, 1024), torch.uint8, torch.device("cpu"), advise=False)
    assert "hg" not in mapping_vm_flags(t.data_ptr())
    t[:8].fill_(1)  # an engine step writing 8 MiB before the prefault reached it
    assert mapping_field(t.data_ptr(), "AnonHugePages") == 0
    prefault = Prefault(t, advise=True)
    prefault.thread.join(timeout=60)
    assert not prefault.thread.is_alive()
    assert int(t.sum()) == 8 << 20
    assert mapping_field(t[40].data_ptr(), "AnonHugePages") >= 32 << 20  # taken by the thread: huge pages
    assert "hg" in mapping_vm_flags(t[40].data_ptr())
