"""Engine cores in one process, a prefill and a decode one over the TCP transport: a KV
transfer that ends calls the connector's wake-up from the transport thread, so the engine loop
(which sleeps on its inputs while it only waits on remote KV) can run the loaded request at once;
and a prefill lease that a decode worker holds (as a GPU-direct load does while it copies) stays
through its expiry and a release until the hold ends.
"""

from __future__ import annotations

import threading
import time

from tandem.engine.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.kv.config import KVTransferConfig
from tandem.kv.connector import make_connectors
from tandem.kv.params import KVTransferParams

PROMPT = list(range(3, 43))  # 40 tokens: two whole blocks of 16 and a partial one
REMOTE_DECODE = KVTransferParams(do_remote_decode=True)


def make_core(directory, role: str, **kv_settings) -> EngineCore:
    kv_config = KVTransferConfig(role=role, **kv_settings)
    return EngineCore(
        EngineConfig(model=str(directory), num_kv_blocks=32), make_connectors(kv_config)
    )


def test_finished_transfers_wake_both_engine_loops(tiny_checkpoints):
    directory = tiny_checkpoints["llama-gqa"]
    prefill, decode = make_core(directory, "prefill"), make_core(directory, "decode")
    woken = {"prefill": threading.Event(), "decode": threading.Event()}
    prefill.connector.set_wakeup(woken["prefill"].set)
    decode.connector.set_wakeup(woken["decode"].set)
    try:
        greedy_one = SamplingParams(temperature=0.0, max_tokens=1)
        prefill.add_request(Request("p", PROMPT, greedy_one, kv_transfer_params=REMOTE_DECODE))
        outputs = []
        while not outputs:
            outputs = [o for o in prefill.step() if o.finish_reason is not None]
        kv_transfer_params = outputs[0].kv_transfer_params
        assert kv_transfer_params.do_remote_prefill
        assert not woken["prefill"].is_set()  # the lease holds until the decode confirms

        request = Request(
            "d",
            PROMPT,
            SamplingParams(temperature=0.0, max_tokens=3),
            kv_transfer_params=kv_transfer_params,
        )
        request.output_token_ids.append(kv_transfer_params.first_token_id)
        decode.add_request(request)
        decode.step()  # schedules the request and starts its load in a transport thread
        assert decode.scheduler.waiting_for_remote
        assert woken["decode"].wait(10), "the finished load did not wake the decode loop"
        assert woken["prefill"].wait(10), "the confirmation did not wake the prefill loop"

        # Woken, each loop's next step sees the transfer's end without any further wait, and
        # schedules the loaded request like a prefix-cache hit: it decodes in that step.
        assert [o.request_id for o in decode.step()] == ["d"]
        assert not decode.scheduler.waiting_for_remote
        assert [r.request_id for r in decode.scheduler.running] == ["d"]
        assert decode.scheduler.requests["d"].num_output_tokens == 2
        prefill.step()
        assert not prefill.scheduler.held_for_remote
        assert prefill.kv_manager.num_used_blocks == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_held_lease_outlives_its_expiry_and_a_release_until_let_go(tiny_checkpoints):
    prefill = make_core(tiny_checkpoints["llama-gqa"], "prefill", lease_timeout_s=0.05)
    control = prefill.connector.control  # the control plane the KV server calls into
    try:
        assert not control._on_transfer_held("p")  # no such lease (yet)
        greedy_one = SamplingParams(temperature=0.0, max_tokens=1)
        prefill.add_request(Request("p", PROMPT, greedy_one, kv_transfer_params=REMOTE_DECODE))
        while not any(output.finish_reason for output in prefill.step()):
            pass
        leased_blocks = prefill.kv_manager.num_used_blocks
        assert leased_blocks == 3
        assert control._on_transfer_held("p")  # what the KV server asks on a decode's hold
        prefill.connector.release("p")  # the router gives up on the request meanwhile
        time.sleep(0.1)  # and the lease's deadline passes
        prefill.step()
        assert prefill.kv_manager.num_used_blocks == leased_blocks  # the decode still copies
        assert "p" in prefill.scheduler.held_for_remote

        control._on_transfer_done("p", False)  # the hold broke: the decode let go unconfirmed
        prefill.step()  # the expiry check ends the lease, the step after frees its blocks
        prefill.step()
        assert prefill.kv_manager.num_used_blocks == 0
        assert not control._on_transfer_held("p")  # an ended lease cannot be held again
    finally:
        prefill.shutdown()
