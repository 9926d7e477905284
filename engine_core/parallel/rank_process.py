"""A tensor-parallel rank other than 0: a process that runs whatever rank 0 sends, in the order it sends it.

Rank 0 (the worker process, which runs the scheduler) starts ranks 1..N-1 with `multiprocessing` (spawn) and
keeps one pipe to each. The exchange over a pipe:

    rank k                                    rank 0
    load its shard, build its KV pool
    "ready"                         ------->  (waits for every rank; a rank that exits instead fails the start)
                                    <-------  "join"
    join the process group (torch.distributed over a TCPStore rank 0 serves, gloo or NCCL, with a timeout)
    loop:                           <-------  ("forward", chunks) | ("copy", pairs) | ("stop", None)
      forward: the same batch as rank 0; its collectives pair with rank 0's
      copy: copy-on-write of KV pages, which must happen on every rank's pool

Waiting for the next message is not a collective, so an idle worker hits no timeout. A rank exits when rank 0
says stop, when its pipe closes (rank 0 died), when its parent process is gone, or on any error (rank 0 sees
the exit and takes the worker down).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankArgs:
    """What a rank process needs to build its shard and find the group (picklable: it crosses spawn)."""

    model_path: str
    model_id: str
    tp_size: int
    rank: int
    num_pages: int
    page_size: int
    device: str  # this rank's device, e.g. "cpu" or "cuda:1"
    dtype: str | None
    store_port: int
    timeout_s: float
    threads: int
    parent_pid: int


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
    """Join the tensor-parallel process group. Every collective on it fails after `timeout_s` instead of waiting
    forever on a rank that hangs or died."""
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _exit_when_orphaned(parent_pid: int) -> None:
    """A rank whose worker is gone (even by SIGKILL, mid-collective) must not keep running."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="duet-tp-parent-watch", daemon=True).start()


def rank_main(args: RankArgs, conn) -> None:
    """Entry of a rank process (multiprocessing target)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{args.rank} %(name)s: "
                                                   f"%(message)s")
    _exit_when_orphaned(args.parent_pid)
    # a signal to the worker's process group (duet up's Ctrl-C or SIGTERM) is the worker's to handle: it drains,
    # then stops its ranks. A rank follows rank 0 (stop, a closed pipe, an orphaned parent), never the signal:
    # dying on it would end the drain of the requests in flight
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _serve(args, conn)
    except (EOFError, ConnectionError):
        log.error("rank 0 is gone; exiting")
        os._exit(1)
    except Exception:
        log.exception("tensor-parallel rank %d failed", args.rank)
        sys.stderr.flush()
        os._exit(1)


def _serve(args: RankArgs, conn) -> None:
    from duet.model_dir import read_model_dir
    from engine_core.parallel.shard_runner import ShardRunner

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model_dir = read_model_dir(Path(args.model_path), args.model_id)
    runner = ShardRunner(model_dir, args.tp_size, args.rank, args.num_pages, args.page_size, device, args.dtype)
    conn.send("ready")
    if conn.recv() != "join":
        return
    store = dist.TCPStore("127.0.0.1", args.store_port, args.tp_size, is_master=False,
                          timeout=timedelta(seconds=args.timeout_s))
    join_group(store, args.rank, args.tp_size, device, args.timeout_s)
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "forward":
            runner.forward(payload)
        elif kind == "copy":
            runner.copy_pages(payload)
        else:
            assert kind == "stop", kind
            return  # the process's exit closes the group's sockets; rank 0 destroys the group
