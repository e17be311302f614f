"""megatron-core's distributed optimizer (``optim.use_distributed_optimizer``) on gloo: its step equals the
plain optimizer's, and its dist_checkpointing state resumes at another DP size and at another TP size
(fp32), and round-trips bit for bit with bf16 params (fp32 main weights). Every DP rank writes its share
of the checkpoint. 2 processes, then 1."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from distributed import run_workers
from test_megatron_checkpoint import _batches, _merged, _nll

from megareason.models.arch import ModelArch

LR = 1e-2
EPS = 1e-3  # see test_megatron_checkpoint: Adam with a tiny eps turns rounding noise into full steps


class GroupStepAdam(torch.optim.Optimizer):
    """AdamW with the state layout of TransformerEngine's (and Apex's) FusedAdam, megatron-core's Adam where
    they are installed (the NGC containers): ``step`` in each parameter group, counted at each ``step()``,
    and only ``exp_avg`` / ``exp_avg_sq`` per parameter, created at the first step. The update is theirs
    with ``adam_w_mode`` (decoupled weight decay)."""

    def __init__(self, params, lr, weight_decay, betas, eps, adam_w_mode=True):
        assert adam_w_mode
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (b1, b2), step = group["betas"], group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** step)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"] / (1 - b1 ** step), denom, value=-group["lr"])


@contextmanager
def _fused_adam_layout():
    """megatron-core builds ``GroupStepAdam`` and takes its TransformerEngine branches, as when TE is installed."""
    import megatron.core.optimizer as mo
    import megatron.core.optimizer.distrib_optimizer as do

    saved = mo.Adam, mo.USING_PYTORCH_OPTIMIZER, do.Adam, do.HAVE_APEX_OR_TE, do.USING_TE_OPTIMIZER
    # the import-time flags of TE's branch: distrib_optimizer.py reads the step from the param groups
    mo.Adam, mo.USING_PYTORCH_OPTIMIZER, do.Adam, do.HAVE_APEX_OR_TE, do.USING_TE_OPTIMIZER = (
        GroupStepAdam, False, GroupStepAdam, True, True)
    try:
        yield
    finally:
        mo.Adam, mo.USING_PYTORCH_OPTIMIZER, do.Adam, do.HAVE_APEX_OR_TE, do.USING_TE_OPTIMIZER = saved


def _trainer(hf, *, distributed: bool, precision: str = "fp32", from_hf: bool = True):
    """A fresh model (HF weights loaded or not) with megatron-core DDP and optimizer on the current layout."""
    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import ComputeSettings, build_gpt, load_hf_weights
    from megareason.models.train import wrap_for_training
    from megareason.settings import optimizer_settings

    compute = ComputeSettings(precision=precision, recompute="none", recompute_num_layers=0, sequence_parallel=False,
                              moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    model = build_gpt(hf.arch, compute)
    if from_hf:
        load_hf_weights(model, hf)
    cfg = Config(optim=OptimConfig(eps=EPS, use_distributed_optimizer=distributed))
    ddp, opt = wrap_for_training(model, optimizer_settings(cfg, LR))
    return model, ddp, opt


def _step(hf, ddp, opt):
    """One step over the global batch, this DP rank's share of it."""
    from megareason.models.logprobs import logprob_head
    from megareason.models.parallel import current_layout
    from megareason.models.train import TrainBatch, train_step

    tokens, mask = _batches(hf.arch.vocab_size)
    layout = current_layout()
    share = tokens.shape[0] // layout.dp
    rows = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
    return train_step(ddp, opt, [TrainBatch(tokens[rows], mask[rows])], logprob_head(hf.arch.vocab_size), _nll).loss


def _params(ddp):
    """In the shape ``_merged`` reads: ((tp_rank, pp_rank, dp_rank), {megatron name: fp32 tensor})."""
    from megareason.models.parallel import current_layout

    layout = current_layout()
    state = {n: p.detach().float().clone() for n, p in ddp.module.named_parameters()}
    return (layout.tp_rank, layout.pp_rank, layout.dp_rank), state


def _stepped(hf, ddp, opt):
    """One step: (the weights after it, as ``_params``, and its loss)."""
    loss = _step(hf, ddp, opt)
    return _params(ddp), loss


def _main_state(opt) -> list[dict[str, torch.Tensor]]:
    """This rank's shard of the fp32 main weights and of every per-parameter optimizer state."""
    (d,) = opt.chained_optimizers
    return [{"param": p.detach().clone(), **{k: v.clone() for k, v in d.optimizer.state[p].items()}}
            for group in d.optimizer.param_groups for p in group["params"]]


def _full_state(model, opt) -> dict[tuple, torch.Tensor]:
    """The model's tensors and the optimizer's per-parameter state (fp32 main weights, moments) gathered
    over DP, by checkpoint key and offset (layers share a key): the same entries at any DP size (TP = PP = 1).
    A DP collective."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from megareason.models.checkpoint import DISTRIB_OPTIM_SHARDING, SHARDING_KEY

    model_sd = model.sharded_state_dict()
    opt_sd = opt.sharded_state_dict(model_sd, metadata={SHARDING_KEY: DISTRIB_OPTIM_SHARDING})
    tensors = []
    for sd in (model_sd, opt_sd):
        apply_factories(sd)  # SwiGLU's fc1: its gate and up halves
        tensors += [sh for sh in nested_values(sd) if isinstance(sh, ShardedTensor)]
    state = {(sh.key, sh.global_offset): sh.data.detach().clone() for sh in tensors}
    assert len(state) == len(tensors)
    return state


def _bytes_written(ckpt: str) -> dict[int, Counter]:
    """Bytes of model and of optimizer state each rank wrote into ``ckpt``: torch_dist's .metadata names
    the file ``__<rank>_<n>.distcp`` that holds every item."""
    from torch.distributed.checkpoint import FileSystemReader

    written: dict[int, Counter] = {}
    for index, info in FileSystemReader(ckpt).read_metadata().storage_data.items():
        rank = int(Path(info.relative_path).name.split("_")[2])
        part = "optimizer" if index.fqn.startswith("optimizer.") else "model"
        written.setdefault(rank, Counter())[part] += info.length
    return written


def _dp2_worker(model_dir: str, ckpt: str, ckpt_bf16: str, ckpt_tp2: str, moe_dir: str, moe_ckpt: str):
    from megareason.models.build import HFCheckpoint
    from megareason.models.checkpoint import finish_saves, load_checkpoint, read_metadata, save_checkpoint
    from megareason.models.offload import TrainingStateOffload
    from megareason.models.parallel import init_parallel

    hf = HFCheckpoint(model_dir)
    out = {}
    init_parallel(1, 1)  # DP=2
    _, ddp, opt = _trainer(hf, distributed=False)
    out[(1, 1, "plain")] = _stepped(hf, ddp, opt)
    model, ddp, opt = _trainer(hf, distributed=True)
    out[(1, 1, "distributed")] = _stepped(hf, ddp, opt)
    out["saved"] = _full_state(model, opt)
    # Asynchronous: the next step changes the parameters and the optimizer state in place while the forked
    # writer writes; the checkpoint holds the state at the save, and appears only once committed.
    save_checkpoint(ckpt, model, hf.arch, model_dir, optimizer=opt, metadata={"step": 1}, asynchronous=True)
    out[(1, 1, "continued")] = _stepped(hf, ddp, opt)  # the uninterrupted run's second step
    out["before_commit"] = sorted(p.name for p in Path(ckpt).parent.iterdir() if p.name.startswith("ckpt"))
    assert finish_saves(blocking=True)
    out["sharding"] = read_metadata(ckpt)["distrib_optim_sharding_type"]
    out["written"] = _bytes_written(ckpt)

    # bf16 params: megatron-core's mixed-precision distributed optimizer (fp32 main weights).
    model, ddp, opt = _trainer(hf, distributed=True, precision="bf16")
    _step(hf, ddp, opt)
    before = _main_state(opt)
    save_checkpoint(ckpt_bf16, model, hf.arch, model_dir, optimizer=opt)
    model2, ddp2, opt2 = _trainer(hf, distributed=True, precision="bf16", from_hf=False)
    load_checkpoint(ckpt_bf16, model2, opt2)
    out["bf16"] = (before, _main_state(opt2))
    # trainer.offload_optimizer: the first run's gradients and optimizer state leave their storages and come
    # back between its steps; the resumed run (never offloaded) is its reference.
    offload = TrainingStateOffload(ddp, opt)
    offload.offload()
    out["offload"] = {"bytes": offload.offloaded_bytes, "params": sum(p.numel() for p in model.parameters()),
                      "emptied": [t.untyped_storage().nbytes() for t, _, _ in offload._host],
                      "kinds": [host is not None for _, host, _ in offload._host],
                      "model_params_kept": all(p.untyped_storage().nbytes() for p in model.parameters())}
    offload.onload()
    out["bf16_next"] = _stepped(hf, ddp, opt), _stepped(hf, ddp2, opt2)

    init_parallel(2, 1)  # TP=2, DP=1
    model, ddp, opt = _trainer(hf, distributed=True, from_hf=False)
    assert load_checkpoint(ckpt, model, opt)["step"] == 1
    save_checkpoint(ckpt_tp2, model, hf.arch, model_dir, optimizer=opt)  # what it loaded, saved at TP=2
    out[(2, 1, "resumed")] = _stepped(hf, ddp, opt)

    init_parallel(1, 1)  # DP=2 again: the replicas read the TP=2 checkpoint a half each and exchange the rest
    model, ddp, opt = _trainer(hf, distributed=True, from_hf=False)
    load_checkpoint(ckpt_tp2, model, opt)
    out["reloaded"] = _full_state(model, opt)

    # MoE: at EP=2 megatron-core chains an optimizer for the experts' parameters beside the dense one's
    moe = HFCheckpoint(moe_dir)
    init_parallel(1, 1, ep=2)
    model, ddp, opt = _trainer(moe, distributed=True)
    save_checkpoint(moe_ckpt, model, moe.arch, moe_dir, optimizer=opt)
    out["moe_meta"], out["moe_ckpt"] = read_metadata(moe_ckpt), moe_ckpt
    init_parallel(1, 1, ep=1)
    model, ddp, opt = _trainer(moe, distributed=True, from_hf=False)
    try:
        load_checkpoint(moe_ckpt, model, opt)
    except ValueError as e:
        out["moe_at_ep1"] = str(e)
    return out


def _timeouts() -> list:
    """How long a collective waits in the default process group and in megatron-core's DP and TP groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    groups = [dist.group.WORLD, ps.get_data_parallel_group(with_context_parallel=True),
              ps.get_tensor_model_parallel_group()]
    return [g._get_backend(torch.device("cpu")).options._timeout for g in groups]


def _dp1_worker(model_dir: str, ckpt: str, unstepped: str, fused: str):
    from megareason.models.build import HFCheckpoint
    from megareason.models.checkpoint import load_checkpoint, save_checkpoint
    from megareason.models.parallel import init_parallel

    hf = HFCheckpoint(model_dir)
    out = {}
    init_parallel(1, 1)  # DP=1
    out["timeouts"] = _timeouts()
    model, ddp, opt = _trainer(hf, distributed=True, from_hf=False)
    assert load_checkpoint(ckpt, model, opt)["step"] == 1
    out["loaded"] = _full_state(model, opt)
    out[(1, 1, "resumed")] = _stepped(hf, ddp, opt)
    model, _, opt = _trainer(hf, distributed=False, from_hf=False)
    try:
        load_checkpoint(ckpt, model, opt)
    except ValueError as e:
        out["plain_error"] = str(e)
    # An optimizer saved before its first step resumes as a fresh one.
    model, ddp, opt = _trainer(hf, distributed=True)
    save_checkpoint(unstepped, model, hf.arch, model_dir, optimizer=opt)
    model2, ddp2, opt2 = _trainer(hf, distributed=True, from_hf=False)
    load_checkpoint(unstepped, model2, opt2)
    out["unstepped"] = _stepped(hf, ddp, opt), _stepped(hf, ddp2, opt2)

    # TransformerEngine's FusedAdam layout (step per group): saved before its first step (a pre-emption in
    # step 1), it resumes as a fresh optimizer; saved after one, the resumed run's next step is the
    # uninterrupted one's.
    with _fused_adam_layout():
        model, ddp, opt = _trainer(hf, distributed=True)
        (d,) = opt.chained_optimizers
        out["fused_class"] = type(d.optimizer).__name__
        save_checkpoint(f"{fused}/unstepped", model, hf.arch, model_dir, optimizer=opt)
        model2, ddp2, opt2 = _trainer(hf, distributed=True, from_hf=False)
        load_checkpoint(f"{fused}/unstepped", model2, opt2)
        out["fused_unstepped"] = _stepped(hf, ddp, opt), _stepped(hf, ddp2, opt2)
        save_checkpoint(f"{fused}/stepped", model, hf.arch, model_dir, optimizer=opt)
        model3, ddp3, opt3 = _trainer(hf, distributed=True, from_hf=False)
        load_checkpoint(f"{fused}/stepped", model3, opt3)
        out["fused_resumed"] = _stepped(hf, ddp, opt), _stepped(hf, ddp3, opt3)
        out["fused_steps"] = [g.get("step") for g in opt3.chained_optimizers[0].optimizer.param_groups]
    return out


@pytest.fixture(scope="module")
def runs(tiny_qwen2, tiny_qwen3_moe, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributed_optimizer")
    dp2 = run_workers(2, _dp2_worker, str(tiny_qwen2), str(tmp / "ckpt"), str(tmp / "ckpt_bf16"), str(tmp / "ckpt_tp2"),
                      str(tiny_qwen3_moe), str(tmp / "moe_ep2"))
    dp1 = run_workers(1, _dp1_worker, str(tiny_qwen2), str(tmp / "ckpt"), str(tmp / "unstepped"), str(tmp / "fused"))
    return ModelArch.from_pretrained(tiny_qwen2), dp2, dp1


def _assert_close(a: dict, b: dict, tol: float, what: str):
    assert set(a) == set(b)
    for name, t in b.items():
        assert (a[name] - t).abs().max().item() < tol, f"{what}: {name}"


def test_step_equals_the_plain_optimizer(runs):
    arch, dp2, _ = runs
    plain = _merged(dp2, (1, 1, "plain"), arch)
    distributed = _merged(dp2, (1, 1, "distributed"), arch)
    second = _merged(dp2, (1, 1, "continued"), arch)
    assert max((second[n] - plain[n]).abs().max().item() for n in plain) > 1e-3  # a step moves weights ~1e-2
    _assert_close(distributed, plain, 1e-6, "distributed vs plain optimizer")
    assert abs(dp2[0][(1, 1, "distributed")][1] - dp2[0][(1, 1, "plain")][1]) < 1e-6


@pytest.mark.parametrize("tp", [1, 2], ids=["dp1", "tp2_dp1"])
def test_resume_reproduces_the_next_step(runs, tp):
    """Saved at DP=2 after one step; loaded at DP=1 (1 process) or TP=2 x DP=1 (2 processes)."""
    arch, dp2, dp1 = runs
    assert dp2[0]["sharding"] == "fully_reshardable"
    continued = _merged(dp2, (1, 1, "continued"), arch)
    per_rank, key = (dp1 if tp == 1 else dp2), (tp, 1, "resumed")
    _assert_close(_merged(per_rank, key, arch), continued, 1e-6, f"resumed at TP={tp}")
    assert abs(per_rank[0][key][1] - dp2[0][(1, 1, "continued")][1]) < 1e-6


def test_every_dp_rank_writes_its_share_and_other_layouts_load_it_exactly(runs):
    """megatron-core's fully parallel save: the DP replicas split the writing of the model and of the
    gathered optimizer state (rather than DP rank 0 writing all of it). Loaded at DP=1, the checkpoint holds
    exactly what DP=2 saved; so does it after a load at TP=2, a save there and a (fully parallel) load at
    DP=2 again."""
    _, dp2, (dp1,) = runs
    # written asynchronously: before the commit only the temporary folder existed
    assert [name.startswith("ckpt.tmp-") for name in dp2[0]["before_commit"]] == [True], dp2[0]["before_commit"]
    # Without the wrapper megatron-core's writer puts all 6.4 MB (1.6 MB model, 4.8 MB optimizer) on rank 0.
    written = dp2[0]["written"]
    assert sorted(written) == [0, 1], written
    total = sum(written.values(), Counter())
    for w in written.values():
        assert 0.3 < w.total() / total.total() < 0.7, written
        for part in ("model", "optimizer"):
            assert 0.3 < w[part] / total[part] < 0.7, (part, written)
    saved = dp2[0]["saved"]
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key, _ in saved)
    for what, loaded in [("DP=1", dp1["loaded"]), ("TP=2 -> DP=2 rank 0", dp2[0]["reloaded"]),
                         ("TP=2 -> DP=2 rank 1", dp2[1]["reloaded"])]:
        assert loaded.keys() == saved.keys(), what
        for key, t in saved.items():
            assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t), f"{what}: {key}"


def test_optimizer_state_saved_at_ep2_is_refused_at_ep1_naming_how_to_go_on(runs):
    """A MoE checkpoint's optimizer state saved at EP=2 (two chained optimizers) loaded at EP=1 (one): every
    rank refuses it before any collective, with the layout to resume at, instead of megatron-core's KeyError
    deep in the load."""
    _, dp2, _ = runs
    meta = dp2[0]["moe_meta"]
    assert (meta["saved_ep"], meta["chained_optimizers"]) == (2, 2)
    path = dp2[0]["moe_ckpt"]
    for rank in dp2:
        assert rank["moe_at_ep1"] == (
            f"{path}: its optimizer state was saved by 2 optimizer(s) at expert parallelism 2, and this run has 1 at "
            "expert parallelism 1: megatron-core keeps the experts' optimizer state in an optimizer of its own when "
            "expert parallelism is > 1, and that state does not reshard between the two splits. Resume with "
            "parallel.expert_model_parallel_size=2 (tensor, pipeline and data parallelism may change), or start a "
            f"new run from its weights alone: megareason convert megatron-to-hf {path} OUT, then model.path=OUT")


def test_collectives_wait_as_long_as_a_save_may_take(runs):
    """The default group's and megatron-core's groups' timeout: torch's default (10 minutes for NCCL)
    does not cover a slow node's checkpoint write."""
    from megareason.models.parallel import COLLECTIVE_TIMEOUT

    _, _, (dp1,) = runs
    assert dp1["timeouts"] == [COLLECTIVE_TIMEOUT] * 3


def test_bf16_main_weights_and_moments_round_trip_exactly(runs):
    _, dp2, _ = runs
    for rank in dp2:
        before, after = rank["bf16"]
        assert len(before) == len(after) > 0
        for b, a in zip(before, after, strict=True):
            assert b["param"].dtype == torch.float32 and set(b) == set(a) == {"param", "step", "exp_avg", "exp_avg_sq"}
            for key in b:
                assert torch.equal(a[key], b[key]), key
        # ... and the next step is the uninterrupted one's, bit for bit (which offloaded its gradient buffer
        # and optimizer state, emptying their storages, and brought them back before this step)
        off = rank["offload"]
        assert off["emptied"] and not any(off["emptied"]) and off["model_params_kept"]
        assert off["kinds"].count(False) == 1  # the gradient buffer (zeroed on return); then weights and moments
        n = off["params"]  # fp32 gradients of every parameter + this rank's half of main weights and 2 moments
        assert 4 * n + 12 * n // 2 <= off["bytes"] <= 4 * n + 12 * n // 2 + 4096
        (continued, loss), (resumed, resumed_loss) = rank["bf16_next"]
        assert resumed_loss == loss
        assert all(torch.equal(resumed[1][n], t) for n, t in continued[1].items())


def test_unstepped_save_resumes_as_fresh_and_a_plain_optimizer_is_refused(runs):
    _, _, (dp1,) = runs
    (fresh, loss), (resumed, resumed_loss) = dp1["unstepped"]
    assert resumed_loss == loss
    assert all(torch.equal(resumed[1][n], t) for n, t in fresh[1].items())
    assert "optim.use_distributed_optimizer=true" in dp1["plain_error"]


def test_fused_adam_state_layout_saves_unstepped_and_resumes_exactly(runs):
    """TransformerEngine's FusedAdam keeps ``step`` per parameter group (``GroupStepAdam``): an unstepped save
    resumes as fresh, and a resumed run's next step, loss and per-group step count are the uninterrupted one's."""
    _, _, (dp1,) = runs
    assert dp1["fused_class"] == "GroupStepAdam"
    for key in ("fused_unstepped", "fused_resumed"):
        (straight, loss), (resumed, resumed_loss) = dp1[key]
        assert resumed_loss == loss, key
        assert all(torch.equal(resumed[1][n], t) for n, t in straight[1].items()), key
    assert dp1["fused_steps"] == [2] * len(dp1["fused_steps"])  # loaded 1, then the step above
