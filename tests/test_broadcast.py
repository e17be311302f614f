"""The collective weight broadcast to separate engines (``rollout.broadcast``): the bucket plan against hand-made
layouts, and the trainer and worker engines over a real gloo group of separate processes (one sender, two
engines of TP 2 and 1), driven through a stand-in for the pool's RPC client (queues instead of Ray): every
worker receives every tensor bit for bit, and a worker that dies mid-update makes the sender raise, not hang."""

from __future__ import annotations

import multiprocessing as mp
import queue
from types import SimpleNamespace

import pytest
import torch
from distributed import run_workers

from megareason.rollout.broadcast import (
    BroadcastTrainerInitInfo,
    BroadcastTrainerWeightTransferEngine,
    BroadcastWeightTransferEngine,
    bucket_size,
    engine_offsets,
    plan_buckets,
    unpack,
)
from megareason.rollout.transfer import HFWeightSource


def test_plan_buckets_fills_in_order_and_gives_a_large_tensor_its_own_bucket():
    f32, bf16 = torch.float32, torch.bfloat16
    meta = [("a", f32, (2, 3)), ("b", f32, (4,)), ("big", f32, (10,)), ("c", bf16, (3,)), ("d", bf16, (5,))]
    plan = plan_buckets(meta, bucket_bytes=40)
    # a: 24 bytes at 0, b: 16 at 24 (40 = full); big: 40 > what is left -> its own; c: 6, d: 10 -> 16
    assert plan == [[("a", "float32", [2, 3], 0), ("b", "float32", [4], 24)],
                    [("big", "float32", [10], 0)],
                    [("c", "bfloat16", [3], 0), ("d", "bfloat16", [5], 6)]]
    assert [bucket_size(b) for b in plan] == [40, 40, 16]
    assert plan_buckets([("huge", f32, (100,))], 40) == [[("huge", "float32", [100], 0)]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(meta, 0)
    assert engine_offsets([2, 1, 4]) == [1, 3, 4]


def test_unpack_gives_views_of_the_buffer():
    x, y = torch.arange(6, dtype=torch.float32).view(2, 3), torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    plan = plan_buckets([("x", x.dtype, x.shape), ("y", y.dtype, y.shape)], 1 << 20)[0]
    buf = torch.cat([x.flatten().view(torch.uint8), y.view(torch.uint8)])
    names, views = unpack(buf, plan)
    assert names == ["x", "y"] and torch.equal(views[0], x) and torch.equal(views[1], y)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(50, 8, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=g),
            "model.norm.weight": torch.randn(8, generator=g)}


class _QueueClient:
    """The pool's client (``rollout.transfer.PoolClient``) over queues: a call goes to each engine (as the
    pool's RPC into its actor, which ``collective_rpc``s every worker of the engine) and waits for every
    worker's answer. ``engines``: per engine, its workers' inboxes."""

    def __init__(self, engines, outbox):
        self.engines, self.outbox, self.seconds = engines, outbox, 0.0

    def _call(self, method, args_per_engine):
        for boxes, args in zip(self.engines, args_per_engine, strict=True):
            for box in boxes:
                box.put((method, args))
        answers = [self.outbox.get(timeout=20) for boxes in self.engines for _ in boxes]
        errors = [a for a in answers if a != "ok"]
        if errors:
            raise RuntimeError(f"{method}: {errors[0]}")

    def init_each(self, payloads):
        self._call("init", [(p,) for p in payloads])

    def start_weight_update(self):
        self._call("start", [()] * len(self.engines))

    def update_weights(self, info):
        self._call("update", [(info,)] * len(self.engines))

    def finish_weight_update(self, weight_version=None):
        self._call("finish", [()] * len(self.engines))


class _Recorder:
    """Stands in for ``vllm_worker._Reload``: keeps what ``load`` receives (copies, as vLLM's loader does)."""

    def __init__(self):
        self.got = {}

    def check(self, names, tensors):
        assert not set(names) & set(self.got), names

    def load(self, names, tensors):
        self.got.update({n: t.clone() for n, t in zip(names, tensors, strict=True)})


def _rank(inboxes, outbox, layout, bucket_bytes, die_at_update):
    """Rank 0 is the trainer's sender; the others are engine workers (``layout``: rank -> (engine tp, tp rank))."""
    import os

    rank = int(os.environ["RANK"])
    weights = _weights()
    if rank == 0:
        source = HFWeightSource(lambda: iter(weights.items()), {n: tuple(t.shape) for n, t in weights.items()},
                                torch.float32)
        info = BroadcastTrainerInitInfo(rank=0, host="127.0.0.1", engine_sizes=[2, 1], bucket_bytes=bucket_bytes,
                                        timeout_s=30)
        client = _QueueClient([inboxes[:2], inboxes[2:]], outbox)  # engine 0: ranks 1, 2; engine 1: rank 3
        engine = BroadcastTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        try:
            update = engine.send_weights(weight_version="1")
        except Exception as e:
            for box in inboxes:  # as the pool would: no more calls reach the engines
                box.put(("stop", ()))
            return f"raised: {e}"
        return update
    tp, tp_rank = layout[rank]
    worker = object.__new__(BroadcastWeightTransferEngine)
    worker.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=tp, rank=tp_rank)
    recorder = _Recorder()
    box = inboxes[rank - 1]
    while True:
        try:
            method, args = box.get(timeout=30)
        except queue.Empty:
            return "no call for 30 s"
        if method == "stop":  # the sender raised: this engine is left idle
            return "idle"
        try:
            if method == "init":
                worker.init_transfer_engine(worker.parse_init_info(args[0]))
            elif method == "start":
                worker._reload = recorder
            elif method == "update":
                if die_at_update == rank:  # the engine's process ends before the first bucket: its sockets close
                    outbox.put(f"rank {rank}: gone")
                    return "gone"
                worker.update_weights(args[0])
            elif method == "finish":
                outbox.put("ok")
                return recorder.got
        except Exception as e:
            outbox.put(f"rank {rank}: {e}")
            return f"raised: {e}"
        outbox.put("ok")


def _queues(n):
    ctx = mp.get_context("forkserver")
    return [ctx.Queue() for _ in range(n)], ctx.Queue()


def test_every_engine_worker_receives_every_tensor_bit_for_bit():
    # Engine 0 of TP 2 (ranks 1, 2) and engine 1 of TP 1 (rank 3); buckets of 600 bytes split the 1600-byte
    # embedding into a bucket of its own and the rest over several.
    inboxes, outbox = _queues(3)
    layout = {1: (2, 0), 2: (2, 1), 3: (1, 0)}
    results = run_workers(4, _rank, inboxes, outbox, layout, 600, None, timeout=120)
    update, received = results[0], results[1:]
    weights = _weights()
    sizes = [t.numel() * 4 for t in weights.values()]
    assert update.bytes == sum(sizes) and update.buckets == len(plan_buckets(
        [(n, t.dtype, tuple(t.shape)) for n, t in weights.items()], 600))
    for got in received:
        assert sorted(got) == sorted(weights)
        for name, t in weights.items():
            assert torch.equal(got[name], t), name


def test_a_worker_that_dies_mid_update_makes_the_sender_raise():
    inboxes, outbox = _queues(3)
    layout = {1: (2, 0), 2: (2, 1), 3: (1, 0)}
    sender, *workers = run_workers(4, _rank, inboxes, outbox, layout, 600, 3, timeout=90)
    assert isinstance(sender, str) and sender.startswith("raised: "), sender
    assert workers[2] == "gone"
    # The surviving engine's ranks got the bucket (gloo's root sent it to them before failing at rank 3) or
    # failed in the same collective; either way nothing waits for them.
    assert all(w == "idle" or (isinstance(w, str) and w.startswith("raised: ")) for w in workers[:2]), workers[:2]
