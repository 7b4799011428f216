"""The KV connector split as vLLM's is (tokenmill/kv_transfer/scheduler_side.py, worker_side.py): the scheduler
and its half of the connector import no torch and move no bytes; a parked request's pull leaves in
``SchedulerOutput.kv_loads`` with the right block range; an ended load requeues the request with only its last
prompt token to compute (or, failed, the whole prompt, counted by reason); an abort or a timeout cancels the
load for the worker half before it could copy a late result. Byte movement itself: tests/test_pd_disagg.py."""
from __future__ import annotations

import subprocess
import sys
import time

from tests.scheduler_helpers import EOS, runner_output
from tokenmill.config import SchedulerConfig
from tokenmill.kv_cache import KVCacheManager
from tokenmill.kv_transfer.config import KVTransferConfig
from tokenmill.kv_transfer.scheduler_side import KVConnectorScheduler, KVLoadResult
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import Scheduler

BLOCK_SIZE = 4


def test_the_scheduler_and_its_connector_half_import_no_torch():
    code = ("import sys; import tokenmill.scheduler.scheduler, tokenmill.kv_transfer.scheduler_side; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def remote_request(request_id: str, prompt: list[int], remote_num_tokens: int | None = None) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=2).with_defaults({})
    kv = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_lease_id": "x",
          "remote_num_tokens": len(prompt) if remote_num_tokens is None else remote_num_tokens}
    return Request(request_id, prompt, params, {EOS}, 2, kv_transfer_params=kv)


def make(timeout_s: float = 30.0):
    connector = KVConnectorScheduler(
        KVTransferConfig(kv_role="kv_consumer", kv_connector_extra_config={"transfer_timeout_s": timeout_s}),
        BLOCK_SIZE)
    kv = KVCacheManager(32, BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128), kv,
                          connector)
    return scheduler, connector, kv


def test_a_parked_request_plans_its_pull_and_resumes_with_one_token_when_it_lands():
    scheduler, connector, kv = make()
    prompt = list(range(100, 114))  # 14 tokens: 13 remote (4 blocks), the last one computed here
    scheduler.add_request(remote_request("r", prompt))
    out = scheduler.schedule()
    assert out.is_empty and len(out.kv_loads) == 1
    load = out.kv_loads[0]
    assert (load.request_id, load.first_block, load.num_blocks) == ("r", 0, 4)
    assert load.block_ids == kv.get_block_ids("r") and load.prompt_token_ids == prompt
    assert scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and connector.has_pending
    assert scheduler.schedule().kv_loads == []  # planned once
    connector.loads_finished([KVLoadResult("r", True, nbytes=1234)])
    out = scheduler.schedule()
    assert [r.request_id for r in out.scheduled_requests] == ["r"] and out.num_scheduled_tokens == [1]
    assert connector.stats.remote_tokens == 13 and connector.stats.bytes_received == 1234
    scheduler.update_from_output(out, runner_output(out))
    assert not connector.has_pending


def test_a_failed_load_computes_the_prompt_here_with_its_reason():
    scheduler, connector, kv = make()
    scheduler.add_request(remote_request("r", list(range(100, 110))))
    scheduler.schedule()
    connector.loads_finished([KVLoadResult("r", False, "corrupt", "the blocks' checksum does not match")])
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [10] and connector.stats.local_fallbacks == {"corrupt": 1}
    assert connector.stats.remote_tokens == 0
    scheduler.update_from_output(out, runner_output(out))
    kv.check_integrity()


def test_abort_and_timeout_cancel_the_load_for_the_worker_half():
    scheduler, connector, kv = make(timeout_s=0.01)
    scheduler.add_request(remote_request("aborted", list(range(100, 110))))
    scheduler.add_request(remote_request("late", list(range(200, 210))))
    assert len(scheduler.schedule().kv_loads) == 2
    scheduler.finish_requests(["aborted"], RequestStatus.FINISHED_ABORTED)
    assert connector.take_cancelled() == ["aborted"] and connector.take_cancelled() == []
    time.sleep(1.1)  # past transfer_timeout_s + 1
    out = scheduler.schedule()  # the late load ends as failed and is computed here
    assert out.num_scheduled_tokens == [10] and connector.stats.local_fallbacks == {"timeout": 1}
    assert connector.take_cancelled() == ["late"]
    connector.loads_finished([KVLoadResult("late", True, nbytes=99)])  # its result came after all: dropped
    assert connector.stats.bytes_received == 0 and connector.stats.remote_prefill_requests == 0


def test_a_remote_num_tokens_short_of_the_prompt_is_not_loaded():
    scheduler, connector, _ = make()
    scheduler.add_request(remote_request("r", list(range(100, 110)), remote_num_tokens=3))
    out = scheduler.schedule()
    assert out.kv_loads == [] and out.num_scheduled_tokens == [10]
    assert connector.stats.local_fallbacks == {"params": 1}
