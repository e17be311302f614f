"""The tmpfs bucket that carries weights from the trainer to vLLM's workers."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from megareason.rollout.buckets import SharedBucket, read_bucket


def test_round_trip_fill_and_grow():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1, 2, 3], dtype=torch.int64)
    c = torch.ones(2, dtype=torch.bfloat16)
    with SharedBucket(capacity=24 + 24) as bucket:
        assert bucket.add("a", a) and bucket.add("b", b)
        assert not bucket.add("c", c)  # 48 bytes used: full, nothing copied
        assert bucket.specs == [("a", "float32", [2, 3], 0), ("b", "int64", [3], 24)]
        names, tensors = read_bucket(bucket.transport(), bucket.specs)
        assert names == ["a", "b"] and torch.equal(tensors[0], a) and torch.equal(tensors[1], b)
        bucket.clear()
        big = torch.randn(100)
        assert bucket.add("big", big) and bucket.capacity == 400  # a lone larger tensor grows the bucket
        (name,), (got,) = read_bucket(bucket.transport(), bucket.specs)
        assert name == "big" and torch.equal(got, big)
        path = bucket.path
        assert os.path.exists(path)
    assert not os.path.exists(path)


def test_unknown_transport():
    with pytest.raises(ValueError, match="unknown bucket transport 'pigeon'"):
        read_bucket(("pigeon", None), [])


# --- what crosses vLLM's collective_rpc ---------------------------------------------------------------


def _through_vllm_rpc(method: str, args: tuple):
    """Encode ``LLM.collective_rpc(method, args=args)``'s message as vLLM's engine-core client does
    (``SyncMPClient.call_utility``: ``(client, call id, "collective_rpc", (method, timeout, args, kwargs))``)
    with vLLM's own msgpack encoder, decode it as the engine core does, and return the decoded args."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    frames = MsgpackEncoder().encode((0, 1, "collective_rpc", (method, None, args, None)))
    _, _, _, (got_method, _, got_args, _) = MsgpackDecoder().decode(frames)
    assert got_method == method
    return got_args


@pytest.fixture
def secure_serialization(monkeypatch):
    """vLLM's default: no pickle fallback in its msgpack encoder."""
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)


def test_shm_bucket_payload_passes_vllms_msgpack_and_carries_the_rollout_dtype(secure_serialization):
    w = torch.randn(3, 5)
    b = torch.arange(4, dtype=torch.float32)
    with SharedBucket(capacity=1024) as bucket:
        assert bucket.add("w", w, torch.bfloat16) and bucket.add("b", b, torch.bfloat16)
        assert bucket.used == 2 * (15 + 4)  # cast while copied in: 2 bytes per value
        transport, specs = _through_vllm_rpc("mr_load_bucket", (bucket.transport(), bucket.specs))
        names, tensors = read_bucket(transport, specs)
    assert names == ["w", "b"]
    assert tensors[0].dtype == torch.bfloat16 and torch.equal(tensors[0], w.to(torch.bfloat16))
    assert torch.equal(tensors[1].float(), b)


def _cuda_rebuild_args(nbytes: int) -> tuple:
    """``reduce_tensor``'s arguments for a CUDA uint8 buffer, with the types torch gives them (making them
    for real needs a GPU): the classes and dtype of a real tensor, CUDA IPC handles as bytes."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    t = torch.empty(nbytes, dtype=torch.uint8)
    args = (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), t.dtype, 3, b"\x11" * 64, nbytes, 0,
            False, b"\x22" * 64, 16, b"\x33" * 64, True)
    assert len(args) == len(inspect.signature(rebuild_cuda_tensor).parameters)
    return args


def test_cuda_ipc_payload_passes_vllms_msgpack_keyed_by_gpu_uuid(secure_serialization):
    from megareason.rollout.buckets import ipc_rebuild_args, ipc_transport

    args = _cuda_rebuild_args(4096)
    specs = [("model.embed_tokens.weight", "bfloat16", [16, 64], 0), ("model.norm.weight", "bfloat16", [64], 2048)]
    # What buckets.py sent before: torch's arguments as they are. vLLM refuses them.
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        _through_vllm_rpc("mr_load_bucket", (("cuda_ipc", args), specs))
    uuid = "GPU-5f0c0f0e-8d5d-4b8e-9a52-0d7e5b4f2a11"
    (kind, handles), got_specs = _through_vllm_rpc("mr_load_bucket", (ipc_transport(args, uuid), specs))
    assert kind == "cuda_ipc" and list(handles) == [uuid]
    assert [list(s) for s in got_specs] == [list(s) for s in specs]
    rebuilt = ipc_rebuild_args(handles[uuid])
    assert len(rebuilt) == len(args)
    for got, want in zip(rebuilt, args, strict=True):
        assert got == want and type(got) is type(want)
    with pytest.raises(ValueError, match="unknown tensor/storage class"):
        ipc_rebuild_args(["Parameter", *handles[uuid][1:]])
    with pytest.raises(ValueError, match="unknown dtype 'not_a_dtype'"):
        ipc_rebuild_args([*handles[uuid][:5], "not_a_dtype", *handles[uuid][6:]])
