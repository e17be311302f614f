"""Run a function on N local processes joined by torch.distributed (gloo on 127.0.0.1).

The ranks are forked from a server process (multiprocessing's forkserver) that has imported torch,
megatron-core and transformers once per test process: a rank starts in a fraction of a second instead of
the ~3 s of CPU those imports take, which every rank of every multi-process test would pay."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import traceback
from datetime import timedelta

import torch

from megareason.ports import rendezvous_store

# What the server imports before it forks the ranks (a module that fails to import is skipped).
PRELOAD = ["distributed", "megatron.core.parallel_state", "megatron.core.models.gpt", "transformers",
           "megareason.models.build", "megareason.models.roles"]


def _exit_with_parent(parent: int) -> None:
    """A rank whose test process died would otherwise wait in a collective forever."""
    import threading
    import time

    def alive() -> bool:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        return True

    def watch():
        while alive():
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _entry(fn, rank, world_size, port, results, args, parent, env):
    _exit_with_parent(parent)
    os.environ.clear()  # the test process's environment now, not the server's from when it started
    os.environ.update(env)
    # The test process holds the rendezvous store (torch's agent-store mode): every rank is its client, so
    # no rank has to bind a port that another process may have taken since it was chosen.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                      TORCHELASTIC_USE_AGENT_STORE="True")
    try:
        # Serialised to bytes: tensors put on a queue directly travel as shared-memory handles that
        # die with this process.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, buffer.getvalue(), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(world_size: int, fn, *args, timeout: float = 600):
    """``fn(*args)`` on every rank; returns the per-rank results. A failing rank fails the call."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    results = ctx.Queue()
    store = rendezvous_store("127.0.0.1", world_size, timedelta(seconds=timeout))
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store.port, results, args, os.getpid(),
                                              dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors = {}, []
    try:
        for _ in range(world_size):
            rank, value, error = results.get(timeout=timeout)
            if error:
                errors.append(f"rank {rank}:\n{error}")
                break
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    except queue.Empty:
        errors.append(f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(out))}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]
