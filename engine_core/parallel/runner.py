"""Rank 0 of a tensor-parallel group: a Runner (engine_core.scheduler_protocol) that the schedulers and the step
loop use exactly like ModelRunner, while N-1 rank processes run the same forward on their shards.

    runner = start_tensor_parallel(model_dir, 2, device="cpu", page_size=16, kv_cache_tokens=4096)
    logits = runner.forward(chunks)      # every rank runs the batch; rank 0 returns [rows, vocab]
    runner.copy_pages(pairs)             # copy-on-write on every rank's KV pool
    runner.close()                       # also at interpreter exit

Start: validate the split (TensorParallelError naming the numbers), start the ranks (engine_core.parallel.
rank_process), load rank 0's shard, wait until every rank has loaded, form the process group, run one warm-up
token through all of them. Faults: after the start a rank that exits, or a collective that fails or times out
(a rank that hangs), takes the whole worker down: rank 0 kills every rank and exits the process with
FATAL_EXIT_CODE, so nothing is left running and the supervisor restarts the group as one.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
from torch import Tensor

from engine_core.errors import TensorParallelError
from engine_core.forward_batch import SeqChunk
from engine_core.kv_pool import pages_for_budget
from engine_core.mkl_on_amd import run_unlocked
from engine_core.parallel.plan import check_divisible, local_config, shard_plan
from engine_core.parallel.rank_process import RankArgs, join_group, rank_main
from engine_core.parallel.shard_runner import ShardRunner

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # any collective, and the group's forming; DUET_TP_TIMEOUT_S overrides
FATAL_EXIT_CODE = 1


def _rank_devices(device: str | torch.device, tp_size: int) -> list[torch.device]:
    device = torch.device(device)
    if device.type != "cuda":
        return [device] * tp_size
    first = device.index or 0
    visible = torch.cuda.device_count()
    if first + tp_size > visible:
        raise TensorParallelError(f"--tensor-parallel-size {tp_size} needs {tp_size} GPUs from cuda:{first}, "
                                  f"{visible} are visible")
    return [torch.device("cuda", first + r) for r in range(tp_size)]


class TensorParallelRunner:
    """The Runner of a worker whose model is split over `tp_size` ranks; this process is rank 0."""

    def __init__(self, shard: ShardRunner, processes: list, conns: list, store: dist.Store) -> None:
        self.shard = shard
        self.config = shard.config
        self.device = shard.device
        self.dtype = shard.dtype
        self.kv_pool = shard.kv_pool  # rank 0's pool: same pages as every rank's, its own KV heads
        self.max_model_len = self.config.max_position_embeddings
        self.tensor_parallel_size = shard.plan.tp_size
        self.forward_seconds = 0.0
        self._processes = processes
        self._conns = conns
        self._store = store  # rank 0 serves the rendezvous; the group's sockets stay open while it lives
        self._serving = False  # False while starting: a fault raises TensorParallelError instead of exiting
        self._closing = False

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, chunks: list[SeqChunk]) -> Tensor:
        """Logits [sum of len(c.logits_positions)] x vocab, fp32, as ModelRunner.forward."""
        for c in chunks:
            assert c.end_pos <= self.max_model_len, f"position {c.end_pos} beyond the model's {self.max_model_len}"
        start = time.perf_counter()
        logits = self._everywhere("forward", list(chunks), self.shard.forward)
        self.forward_seconds += time.perf_counter() - start
        return logits

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        self._everywhere("copy", list(pairs), self.shard.copy_pages)

    def _everywhere(self, kind: str, payload, local):
        message = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(message)
            return local(payload)
        except Exception as exc:  # noqa: BLE001 (any failure leaves the ranks out of step for good)
            self._fatal(f"tensor-parallel {kind} failed on rank 0: {exc!r}")

    def time_collectives_exactly(self) -> None:
        """On CUDA, synchronize around each all-reduce so its time is its own (slower; the benchmark's choice)."""
        self.shard.comm.sync_timing = self.device.type == "cuda"

    def stats(self) -> dict:
        """Seconds rank 0 spent in forward, in all-reduces and in the logits gather (the benchmark reads them)."""
        comm = self.shard.comm
        return {"forward_seconds": self.forward_seconds, "all_reduce_seconds": comm.all_reduce_seconds,
                "all_reduce_calls": comm.all_reduce_calls, "gather_seconds": comm.gather_seconds}

    # -- lifecycle ------------------------------------------------------------------------------
    def serve(self) -> None:
        """From now on any fault takes the worker down; a daemon thread waits for a rank to exit."""
        self._serving = True

        def run() -> None:
            sentinels = {p.sentinel: p for p in self._processes}
            ready = wait(list(sentinels))
            if not self._closing:
                p = sentinels[ready[0]]
                p.join(0.1)
                self._fatal(f"tensor-parallel rank process {p.name} (pid {p.pid}) exited with code {p.exitcode}")

        threading.Thread(target=run, name="duet-tp-watch", daemon=True).start()

    def _fatal(self, reason: str) -> None:
        if self._closing or not self._serving:
            raise TensorParallelError(reason)
        self._closing = True
        log.critical("%s; stopping every rank and this worker (exit %d)", reason, FATAL_EXIT_CODE)
        _kill(self._processes)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(FATAL_EXIT_CODE)

    def close(self) -> None:
        """Stop every rank (idempotent)."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)  # and let the shard's memory go with the runner
        stop = pickle.dumps(("stop", None))
        for conn in self._conns:
            try:
                conn.send_bytes(stop)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10.0
        for p in self._processes:
            p.join(max(0.0, deadline - time.monotonic()))
        _kill(self._processes)
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(5.0)


def start_tensor_parallel(model_dir, tp_size: int, *, device: str | torch.device = "cpu", page_size: int = 16,
                          kv_cache_tokens: int | None = None, kv_cache_memory_gb: float | None = None,
                          dtype: str | None = None, timeout_s: float | None = None) -> TensorParallelRunner:
    """Start ranks 1..tp_size-1, load rank 0 here, and return rank 0's Runner once the group has run a token.

    The KV budget is per rank: a memory budget counts only the rank's KV heads (kv_cache_memory_gb on each
    device); every rank gets the same number of pages."""
    config = model_dir.config
    check_divisible(config, tp_size)
    devices = _rank_devices(device, tp_size)
    timeout_s = timeout_s or float(os.environ.get("DUET_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    num_pages = pages_for_budget(local_config(config, shard_plan(config, tp_size, 0)), page_size,
                                 kv_cache_tokens=kv_cache_tokens, kv_cache_memory_gb=kv_cache_memory_gb, dtype=dtype)
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])  # NCCL binds rank 0 to the current device
    threads = max(1, torch.get_num_threads() // tp_size)  # the worker's share of the cores, split over its ranks
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", 0, tp_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    processes, conns = [], []
    for rank in range(1, tp_size):
        ours, theirs = ctx.Pipe()
        args = RankArgs(str(model_dir.path), model_dir.model_id, tp_size, rank, num_pages, page_size,
                        str(devices[rank]), dtype, store.port, timeout_s, threads, os.getpid())
        # the rank unlocks MKL before it imports torch, as this worker did at its start (mkl_on_amd.py)
        p = ctx.Process(target=run_unlocked, args=(pickle.dumps((rank_main, args)), theirs),
                        name=f"duet-tp-rank{rank}", daemon=True)
        p.start()
        theirs.close()
        processes.append(p)
        conns.append(ours)
    try:
        shard = ShardRunner(model_dir, tp_size, 0, num_pages, page_size, devices[0], dtype)
        _wait_ready(processes, conns)
        for conn in conns:
            conn.send("join")
        join_group(store, 0, tp_size, devices[0], timeout_s)
        runner = TensorParallelRunner(shard, processes, conns, store)
        runner.forward([SeqChunk([0], 0, [0])])  # every rank's collectives (and NCCL's setup) run once now
        runner.serve()
    except BaseException:
        _kill(processes)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    atexit.register(runner.close)
    log.info("tensor parallel: %d ranks on %s, %d KV pages of %d tokens per rank, collective timeout %.0f s",
             tp_size, ", ".join(map(str, devices)), num_pages, page_size, timeout_s)
    return runner


def _wait_ready(processes, conns) -> None:
    """Block until every rank has loaded its shard; a rank that exits first fails the start with its code."""
    pending = dict(zip(conns, processes))
    while pending:
        for ready in wait([*pending, *(p.sentinel for p in pending.values())]):
            for conn, p in list(pending.items()):
                if ready is conn or ready == p.sentinel:
                    try:
                        if conn.poll() and conn.recv() == "ready":
                            del pending[conn]
                            continue
                    except (EOFError, OSError):
                        pass
                    p.join(1.0)
                    if not p.is_alive():
                        raise TensorParallelError(f"tensor-parallel rank process {p.name} exited with code "
                                                  f"{p.exitcode} while loading (its log is above)")
