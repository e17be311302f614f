"""dist_checkpointing save/load (resharded), optimizer resume, and the conversion commands."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from distributed import run_workers
from safetensors.torch import load_file

from megareason.models import weight_map
from megareason.models.arch import ModelArch


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megareason.cli", *args], capture_output=True, text=True,
                          timeout=600)


def _save_at_tp2_pp2(saves: list[tuple[str, str, tuple[int, int, int]]]):
    """Each (HF model, checkpoint folder, TP x PP x EP layout) in turn, in one set of 4 ranks."""
    import psutil

    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.checkpoint import save_checkpoint
    from megareason.models.parallel import init_parallel

    for model_dir, out, (tp, pp, ep) in saves:
        init_parallel(tp, pp, ep=ep)
        ckpt = HFCheckpoint(model_dir)
        model = build_gpt(ckpt.arch)
        load_hf_weights(model, ckpt)
        save_checkpoint(out, model, ckpt.arch, model_dir)
        save_checkpoint(out, model, ckpt.arch, model_dir)  # replacing an existing checkpoint is atomic too
        # dist_checkpointing's writer Manager process is stopped after each save, not left to outlive us
        # (multiprocessing's own resource tracker, if any, exits with its parent)
        children = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
        assert [c for c in children if "resource_tracker" not in c] == []


# Llama (GQA, no biases, tied embeddings over PP) is covered by Qwen3, which adds per-head q/k norms to it.
LAYOUTS = {"tiny_qwen2": (2, 2, 1), "tiny_qwen3": (2, 2, 1), "tiny_qwen3_moe": (1, 2, 2), "tiny_mixtral": (1, 1, 4)}


@pytest.fixture(scope="module")
def saved_at_tp2_pp2(request, tmp_path_factory):
    """Every family of LAYOUTS saved at its layout by one set of 4 ranks: family -> (HF model, its folder)."""
    tmp = tmp_path_factory.mktemp("saved_at_tp2_pp2")
    models = {family: request.getfixturevalue(family) for family in LAYOUTS}
    run_workers(4, _save_at_tp2_pp2, [(str(models[f]), str(tmp / f / "ckpt"), layout) for f, layout in LAYOUTS.items()])
    return {family: (models[family], tmp / family) for family in LAYOUTS}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(LAYOUTS))
def test_hf_to_megatron_tp2_pp2_to_hf_is_byte_identical(family, saved_at_tp2_pp2, tmp_path):
    """Saved at TP x PP x EP (MoE: the experts spread over 2 or 4 expert-parallel ranks), exported at 1 x 1 x 1."""
    model_dir, folder = saved_at_tp2_pp2[family]
    ckpt = folder / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt"]  # no temporary directories left
    # megatron-to-hf loads the TP=2, PP=2 checkpoint at TP=1, PP=1.
    result = _cli("convert", "megatron-to-hf", str(ckpt), str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    original, converted = load_file(model_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(converted) == set(original)
    for name, t in original.items():
        assert converted[name].dtype == t.dtype and torch.equal(converted[name], t), name
    for f in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "hf" / f).read_bytes() == (model_dir / f).read_bytes()


LR = 1e-2


def _batches(vocab):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (4, 10), generator=g)
    return tokens, torch.ones(4, 10)


def _nll(logp_BT, entropy_BT, batch):
    return -(logp_BT * batch.loss_mask_BT).sum(), batch.loss_mask_BT[:, 1:].sum(), {}


def _resume_worker(model_dir: str, ckpt: str):
    """Step 1 and save at TP=2, PP=2; resume at TP=1, PP=2 and at TP=2, PP=2; step 2 must agree."""
    from megareason.config.schema import Config, OptimConfig
    from megareason.models.build import HFCheckpoint, build_gpt, load_hf_weights
    from megareason.models.checkpoint import load_checkpoint, save_checkpoint
    from megareason.models.logprobs import logprob_head
    from megareason.models.parallel import init_parallel
    from megareason.models.train import TrainBatch, train_step, wrap_for_training
    from megareason.settings import optimizer_settings

    hf = HFCheckpoint(model_dir)
    tokens, mask = _batches(hf.arch.vocab_size)

    def step(ddp, opt, layout):
        share = tokens.shape[0] // layout.dp
        rows = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
        return train_step(ddp, opt, [TrainBatch(tokens[rows], mask[rows])], logprob_head(hf.arch.vocab_size), _nll)

    def params(ddp, layout):
        state = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        return (layout.tp_rank, layout.pp_rank, layout.dp_rank), state

    out = {}
    for tp, pp, resume in [(2, 2, False), (1, 2, True), (2, 2, True)]:
        layout = init_parallel(tp, pp)
        model = build_gpt(hf.arch)
        # eps 1e-3: the k-projection bias has a zero gradient in exact arithmetic (softmax is shift
        # invariant), and Adam with a tiny eps would turn its rounding noise into full-size steps.
        ddp, opt = wrap_for_training(model, optimizer_settings(Config(optim=OptimConfig(eps=1e-3)), LR))
        if resume:
            meta = load_checkpoint(ckpt, model, opt)
            assert meta["step"] == 1
        else:
            load_hf_weights(model, hf)
            step(ddp, opt, layout)
            save_checkpoint(ckpt, model, hf.arch, model_dir, optimizer=opt, metadata={"step": 1})
        result = step(ddp, opt, layout)
        out[(tp, pp, resume)] = (params(ddp, layout), result.loss)
    return out


def _merged(per_rank, key, arch):
    tp, pp, _ = key
    shards = {}
    for results in per_rank:
        (t, p, d), state = results[key][0]
        if d == 0:
            shards[(t, p)] = state
    return weight_map.to_hf(shards, arch, tp, pp)


@pytest.mark.slow
def test_optimizer_state_resumes_across_layouts(tiny_qwen2, tmp_path):
    arch = ModelArch.from_pretrained(tiny_qwen2)
    per_rank = run_workers(4, _resume_worker, str(tiny_qwen2), str(tmp_path / "ckpt"))
    continued = _merged(per_rank, (2, 2, False), arch)
    for key in [(1, 2, True), (2, 2, True)]:
        resumed = _merged(per_rank, key, arch)
        for name, t in continued.items():
            assert (resumed[name] - t).abs().max().item() < 1e-5, f"{key} {name}"  # steps are ~1e-2
        assert abs(per_rank[0][key][1] - per_rank[0][(2, 2, False)][1]) < 1e-6


def test_convert_errors_are_clear(tmp_path):
    result = _cli("convert", "megatron-to-hf", str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 2 and "not a megareason checkpoint" in result.stderr
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox"}')
    result = _cli("convert", "hf-to-megatron", str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 2 and "unsupported architecture model_type='gpt_neox'" in result.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "megareason.json").write_text('{"arch": {}, "has_optimizer": false}')  # no "lora": full weights
    result = _cli("convert", "megatron-to-hf", str(tmp_path), str(tmp_path / "out"), "--peft")
    assert result.returncode == 2 and "--peft needs a checkpoint trained with LoRA" in result.stderr
    assert not (tmp_path / "out").exists()
