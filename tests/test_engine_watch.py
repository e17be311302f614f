"""The rollout worker's watch on its vLLM engine core: whichever sees the core die first (the
watch's poll, or vLLM raising ``EngineDeadError`` from the call in flight) the worker exits with code 70
and one log line naming the dead process; an ordinary error from a live engine is raised as it is.

The "engine core" here is a child process renamed ``VLLM::EngineCore`` (what ``vllm.LLM`` starts), so the
watch finds it the way it finds vLLM's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging, os, signal, subprocess, sys, time
    from megareason.rollout.engine import _EngineWatch, _exits_if_the_core_died

    logging.basicConfig(level=logging.INFO)
    core = subprocess.Popen([sys.executable, "-c",
        "open('/proc/self/comm', 'w').write('VLLM::EngineCore'); import time; time.sleep(120)"])
    while open(f"/proc/{core.pid}/comm").read().strip() != "VLLM::EngineCor":  # comm keeps 15 characters
        time.sleep(0.05)

    class EngineDeadError(RuntimeError):  # vLLM's name; the watch reads the name only
        pass

    class Engine:
        def __init__(self):
            self._watch = _EngineWatch(poll_s=3600)  # its own poll never comes: the call must see it

        @_exits_if_the_core_died
        def live_error(self):
            raise ValueError("a bad prompt")

        @_exits_if_the_core_died
        def generate(self):
            os.kill(core.pid, signal.SIGKILL)
            raise EngineDeadError("EngineCore encountered an issue")

    engine = Engine()
    assert engine._watch.cores, "the renamed child was not found as an engine core"
    try:
        engine.live_error()
    except ValueError:
        print("live error raised", flush=True)
    engine.generate()
    print("not reached", flush=True)
""")


def test_an_engine_dead_error_from_the_call_exits_the_worker_like_the_watch():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 70, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["live error raised"], done.stdout
    assert "the vLLM engine core process (pid" in done.stderr and "the worker exits" in done.stderr, done.stderr
