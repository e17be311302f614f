"""The tmpfs bucket that carries weights from the trainer to vLLM's workers."""

from __future__ import annotations

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
