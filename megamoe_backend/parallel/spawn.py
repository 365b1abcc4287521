"""Run a function on N local ranks (one process each) joined in a torch.distributed group.

Used by `megamoe demo`, the multi-rank tests and the GPU validation script. Each worker gets
(rank, world_size, *args) after init_process_group; its return value (picklable) comes back per
rank, and an exception in any worker is re-raised here with the rank and traceback. A worker that
hangs is killed after ``timeout_s``, so a broken collective can never hang the caller.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, pg_timeout_s: float, fn: Callable, args: tuple, queue) -> None:
    try:
        import torch

        # one thread per rank: N ranks share this machine's cores, oversubscription only adds noise
        torch.set_num_threads(int(os.environ.get("MEGAMOE_RANK_THREADS", "1")))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        # plain pickle (a copy), not torch shared memory: the child may exit before the parent reads
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    pg_timeout_s: float = 60.0,
    tolerate_exit: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    A rank that exits without reporting is an error, unless ``tolerate_exit`` (tests that kill a
    peer on purpose), in which case its result is None.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, backend, pg_timeout_s, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    exited: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) + len(exited) < world_size:
            try:
                rank, kind, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results) - exited)
                    errors.append(f"ranks {missing} produced no result within {timeout_s:.0f}s")
                    break
                for r, p in enumerate(procs):
                    if p.exitcode is not None and r not in results and r not in exited and queue.empty():
                        exited.add(r)
                        if not tolerate_exit:
                            errors.append(f"--- rank {r} --- exited with code {p.exitcode} before reporting")
                continue
            if kind == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise WorkerError("\n".join(errors))
    return [results.get(r) for r in range(world_size)]
