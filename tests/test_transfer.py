"""The trainer side of the ``megareason_shm`` weight transfer (vLLM's weight-transfer API), against a client
that records what the engines would receive and reads every bucket back, as a worker would."""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from megareason.rollout.buckets import read_bucket
from megareason.rollout.transfer import HFWeightSource, ShmTrainerInitInfo, ShmTrainerWeightTransferEngine
from megareason.rollout.vllm_worker import SHM_BACKEND


class Recorder:
    """A ``VLLMWeightSyncClient`` that keeps the calls and copies each bucket's tensors out when it arrives
    (the trainer refills the bucket next)."""

    def __init__(self, fail_at: int | None = None):
        self.calls, self.received, self.seconds, self.fail_at = [], {}, 0.0, fail_at

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")
        if self.fail_at is not None and self.calls.count("update") == self.fail_at:
            raise RuntimeError("engine refused the bucket")
        names, views = read_bucket(tuple(update_info["transport"]), [tuple(s) for s in update_info["specs"]])
        self.received.update({n: v.clone() for n, v in zip(names, views, strict=True)})

    def finish_weight_update(self, weight_version=None):
        self.calls.append(f"finish {weight_version}")


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
            "model.norm.weight": torch.randn(8, generator=g)}


def test_both_sides_are_registered_in_vllms_factories():
    assert SHM_BACKEND in WeightTransferEngineFactory._registry
    assert SHM_BACKEND in WeightTransferTrainerFactory._registry


def test_send_weights_ships_every_tensor_in_buckets_in_the_engines_dtype():
    weights, passes = _weights(), []

    def stream():
        passes.append(1)
        return iter(weights.items())

    source = HFWeightSource(stream, {n: tuple(t.shape) for n, t in weights.items()}, torch.bfloat16)
    assert [(m.name, m.dtype, m.shape) for m in source.metadata()] == [
        (n, torch.bfloat16, tuple(t.shape)) for n, t in weights.items()]
    client = Recorder()
    # 300 bytes: the embedding (16 x 8 bf16 = 256 bytes) fills the first bucket, the rest share the second
    engine = WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=0, bucket_bytes=300), client=client,
                                                       source=source)
    assert isinstance(engine, ShmTrainerWeightTransferEngine) and client.calls == ["init"]
    update = engine.send_weights(weight_version="1")
    assert client.calls == ["init", "start", "update", "update", "finish 1"]
    assert update.buckets == 2 and update.bytes == (128 + 64 + 8) * 2 and update.largest_bucket == 256
    for name, t in weights.items():
        assert client.received[name].dtype == torch.bfloat16 and torch.equal(client.received[name], t.bfloat16())
    engine.send_weights(weight_version="2")  # a fresh pass of the source each round
    assert len(passes) == 2 and client.calls[-1] == "finish 2"


def test_a_failed_bucket_closes_the_update_and_reports_the_first_error():
    weights = _weights()
    client = Recorder(fail_at=2)
    engine = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, bucket_bytes=300), client=client,
        source=HFWeightSource(lambda: iter(weights.items()), {}, torch.float32))
    with pytest.raises(RuntimeError, match="engine refused the bucket"):
        engine.send_weights()
    assert client.calls == ["init", "start", "update", "update", "finish None"]


def test_a_non_sender_rank_only_iterates_the_source():
    weights, seen = _weights(), []
    client = Recorder()

    def stream():
        for item in weights.items():
            seen.append(item[0])
            yield item

    engine = WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=1, bucket_bytes=300), client=client,
                                                       source=HFWeightSource(stream, {}, torch.float32))
    update = engine.send_weights()
    assert seen == list(weights) and client.calls == [] and update.bytes == 0
