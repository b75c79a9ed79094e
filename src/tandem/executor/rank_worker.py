"""The process of a tensor-parallel rank other than 0: joins the group, loads its shard, then
runs what rank 0 sends it until told to stop.

    started -> join the group -> load the shard -> loaded -> { PlanKVCache | InitializeKVCache
                                                               | ExecuteModel }* -> Shutdown

Each stage that rank 0 waits for gets a `RankReply` (an error as a sentence: rank 0 then fails
the engine's start with it). A step that raises here raises on rank 0 too (the same batch, the
same code): it is logged and the loop goes on, as rank 0's engine does. The process dies with
its parent (the engine core), and ignores SIGINT: the engine core decides when it stops.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback

import msgspec
import torch
import zmq

from tandem.distributed.group import StoreAddress, join_group
from tandem.engine.config import EngineConfig
from tandem.executor.rank import (
    MESSAGE_DECODER,
    BlockTables,
    ExecuteModel,
    InitializeKVCache,
    PlanKVCache,
    Rank,
    RankReply,
    Shutdown,
    peer_memory_dtype,
    rank_device,
)
from tandem.kv.connector.base import KVConnectorWorker, NoKVConnectorWorker, RankKVTransfer
from tandem.lifetime import die_with_parent
from tandem.models.source import ModelSource

logger = logging.getLogger(__name__)


def run_rank(
    config: EngineConfig,
    source: ModelSource,
    rank: int,
    store_address: StoreAddress,
    input_address: str,
    reply_address: str,
    parent_pid: int,
) -> None:
    """Process entry point of rank `rank` (1 or more)."""
    die_with_parent(parent_pid)
    for signum in (signal.SIGINT, signal.SIGTERM):  # the engine core stops this rank
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s",
    )
    size = config.tensor_parallel_size
    if rank_device(config, rank).type == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    replies = context.socket(zmq.PUSH)
    replies.connect(reply_address)
    encoder = msgspec.msgpack.Encoder()

    def reply(**fields) -> None:
        replies.send(encoder.encode(RankReply(rank, **fields)))

    try:
        reply()  # started: joining the group
        device = rank_device(config, rank)
        tp = join_group(rank, size, store_address, device, None, peer_memory_dtype(config))
        model_rank = Rank(config, source, tp)
    except Exception as exc:
        logger.error("rank %d failed to start:\n%s", rank, traceback.format_exc())
        reply(error=f"{type(exc).__name__}: {exc}")
        context.destroy(linger=1000)
        return
    reply()  # loaded
    try:
        serve(inputs, model_rank, reply)
    finally:
        context.destroy(linger=0)


def serve(inputs: zmq.Socket, model_rank: Rank, reply) -> None:
    block_tables = BlockTables()
    while True:
        message = MESSAGE_DECODER.decode(inputs.recv())
        match message:
            case ExecuteModel():
                # outside the try: tables out of step with rank 0's end this rank (its exit
                # fails the executor) rather than run a step on wrong blocks
                scheduler_output = block_tables.restore(message)
                try:  # queued on the device; nothing here waits for it
                    model_rank.runner.launch(scheduler_output)
                except Exception:  # rank 0's step raised alike: its requests fail there
                    logger.error("a step failed:\n%s", traceback.format_exc())
            case PlanKVCache():
                try:
                    reply(num_blocks=model_rank.plan_kv_cache().num_blocks)
                except Exception as exc:
                    reply(error=f"{type(exc).__name__}: {exc}")
            case InitializeKVCache(num_blocks, max_model_len, kv_transfer):
                try:
                    connector = NoKVConnectorWorker()
                    if kv_transfer is not None:
                        connector = shard_connector(model_rank, kv_transfer)
                    model_rank.initialize_kv_cache(num_blocks, connector, max_model_len)
                    reply()
                except Exception as exc:
                    reply(error=f"{type(exc).__name__}: {exc}")
            case Shutdown():
                return


def shard_connector(model_rank: Rank, kv_transfer: RankKVTransfer) -> KVConnectorWorker:
    """A PD role's worker side on this rank: its part in rank 0's relay of the KV shards (tcp),
    or its own data plane (the planes that read in place)."""
    from tandem.kv.connector.rank_reads import other_rank_connector

    num_kv_heads = model_rank.source.config.num_kv_heads
    return other_rank_connector(model_rank.tp, num_kv_heads, kv_transfer, model_rank.device)


def main() -> None:
    """`python -m tandem.executor.rank_worker`, run_rank's arguments pickled on stdin. Leaves
    without the interpreter's teardown, as the engine core does: a gloo thread that is still
    letting go of the last collective's tensors takes the GIL, which the teardown has ended,
    and aborts the process (SIGABRT, "terminate called without an active exception")."""
    run_rank(*pickle.load(sys.stdin.buffer))
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
