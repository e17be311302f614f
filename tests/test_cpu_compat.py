"""One test per megatron-core CPU patch in ``megareason.models.cpu_compat``.

The patches are process-wide, so they are applied and probed in a separate process (via
``run_workers``), whose findings each test then checks against an independent expectation.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_workers

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the patches apply only without CUDA")


def _probe():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from megareason.models import cpu_compat
    from megareason.models.parallel import init_parallel

    assert cpu_compat.apply() is True
    init_parallel(1, 1, seed=123)
    found = {"applied_twice": cpu_compat.apply()}
    # (1) current_device
    found["current_device"] = torch.cuda.current_device()
    found["rope_device"] = str(RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(5).device)
    # (2) synchronize
    found["synchronize"] = torch.cuda.synchronize()
    # (3) RNG tracker: inside fork() the CPU generator runs the model-parallel stream, outside it the
    # default stream continues untouched.
    model_parallel_cuda_manual_seed(123)
    torch.manual_seed(7)
    with get_cuda_rng_tracker().fork():
        found["forked"] = torch.rand(3)
    found["after_fork"] = torch.rand(3)
    # (4) device="cuda" factories, Tensor.cuda(), Tensor.to("cuda")
    t = torch.ones(2)
    found["factory_device"] = str(torch.zeros(2, device="cuda").device)
    found["tensor_device"] = str(torch.tensor([1.0], device=torch.device("cuda")).device)
    found["cuda_is_self"] = t.cuda() is t
    found["to_cuda_device"] = str(t.to("cuda").device)
    # (5) clip_grad_by_total_norm_fp32
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    p.grad, q.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    clip_grads.clip_grad_by_total_norm_fp32([p, q], max_norm=1.0, total_norm=5.0)
    found["clipped"] = (p.grad.clone(), q.grad.clone())
    clip_grads.clip_grad_by_total_norm_fp32([p, q], max_norm=10.0, total_norm=1.0)
    found["not_clipped"] = (p.grad.clone(), q.grad.clone())
    patched = clip_grads.clip_grad_by_total_norm_fp32
    found["optimizer_uses_patch"] = mcore_optimizer.clip_grad_by_total_norm_fp32 is patched
    found["grad_norm"] = clip_grads.get_grad_norm_fp32([torch.tensor([3.0, 0.0]), torch.tensor([4.0])])
    # (6) the fused-softmax fallback's causal mask, also inside a backward pass (activation recomputation)
    from megatron.core.fusions import fused_softmax

    found["causal_mask"] = fused_softmax.get_default_causal_mask(3)

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            found["mask_in_backward"] = fused_softmax.get_default_causal_mask(2)
            return grad

    InBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
    # (7) Tensor.type() names the CUDA type (the optimizers' parameter checks); conversions still work
    found["type_names"] = (torch.zeros(1).type(), torch.zeros(1, dtype=torch.bfloat16).type())
    found["type_conversion"] = torch.zeros(1).type(torch.float64).dtype
    return found


@pytest.fixture(scope="module")
def found():
    return run_workers(1, _probe)[0]


def test_apply_is_idempotent(found):
    assert found["applied_twice"] is True


def test_current_device_is_cpu(found):
    assert found["current_device"] == "cpu" and found["rope_device"] == "cpu"


def test_synchronize_is_a_noop(found):
    assert found["synchronize"] is None


def test_rng_tracker_runs_on_the_cpu_generator(found):
    # megatron-core seeds the model-parallel stream with seed + 2718 + tp_rank
    expected_forked = torch.rand(3, generator=torch.Generator().manual_seed(123 + 2718))
    expected_after = torch.rand(3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(found["forked"], expected_forked)
    assert torch.equal(found["after_fork"], expected_after)


def test_cuda_factories_and_moves_stay_on_cpu(found):
    assert found["factory_device"] == "cpu" and found["tensor_device"] == "cpu"
    assert found["cuda_is_self"] is True and found["to_cuda_device"] == "cpu"


def test_clip_grad_by_total_norm(found):
    coeff = 1.0 / (5.0 + 1e-6)
    p, q = found["clipped"]
    assert torch.allclose(p, torch.tensor([3.0 * coeff, 0.0])) and torch.allclose(q, torch.tensor([4.0 * coeff]))
    assert all(torch.equal(a, b) for a, b in zip(found["not_clipped"], found["clipped"], strict=True))
    assert found["optimizer_uses_patch"] is True
    assert found["grad_norm"] == pytest.approx(5.0)


def test_causal_mask_is_built_on_the_cpu_even_in_backward(found):
    expected = torch.tensor([[False, True, True], [False, False, True], [False, False, False]])
    assert torch.equal(found["causal_mask"], expected)
    assert torch.equal(found["mask_in_backward"], expected[1:, 1:])


def test_tensor_type_names_the_cuda_type(found):
    assert found["type_names"] == ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor")
    assert found["type_conversion"] == torch.float64


def _moe_probe():
    """The MoE dispatcher's patches, on 2 gloo ranks (the uneven collectives need two)."""
    import numpy as np
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from megareason.models.parallel import init_parallel

    layout = init_parallel(2, 1)
    found = {}
    # side stream, its context, current_stream and the event it records
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        found["in_stream"] = torch.ones(1).sum().item()
    stream.wait_stream(torch.cuda.current_stream())
    found["stream_differs"] = torch.cuda.current_stream() != stream
    found["event"] = stream.record_event().synchronize()
    # split sizes become numpy arrays (gloo's all_to_all_single wants ints), other tensors stay
    found["as_numpy"] = isinstance(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([2, 3]), as_numpy=True),
                                   np.ndarray)
    found["same_module"] = moe_utils.maybe_move_tensor_to_cpu is token_dispatcher.maybe_move_tensor_to_cpu
    # uneven all-gather: rank r contributes r + 1 rows of value r; uneven reduce-scatter: rank r keeps
    # sizes[r] rows of the sum over ranks
    group = ps.get_tensor_model_parallel_group()
    r = layout.tp_rank
    found["gathered"] = mappings._gather_along_first_dim(torch.full((r + 1, 2), float(r)), group, [1, 2])
    rows = torch.arange(6.0).reshape(3, 2) * (r + 1)
    found["scattered"] = mappings._reduce_scatter_along_first_dim(rows, group, [1, 2])
    found["rank"] = r
    dist.barrier()
    return found


def test_moe_dispatcher_stand_ins():
    for found in run_workers(2, _moe_probe):
        assert found["in_stream"] == 1.0 and found["stream_differs"] and found["event"] is None
        assert found["as_numpy"] and found["same_module"]
        assert torch.equal(found["gathered"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        total = torch.arange(6.0).reshape(3, 2) * 3  # rank 0's rows + rank 1's (twice rank 0's)
        assert torch.equal(found["scattered"], total[:1] if found["rank"] == 0 else total[1:])
