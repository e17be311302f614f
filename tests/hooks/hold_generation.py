"""A generation that lasts until it is stopped, as a long generation of a large model does: the live
pre-emption test (tests/test_nemo_run.py) and the killed engine (tests/test_async_rollouts.py).

While the file named by ``MEGAREASON_TEST_HOLD_GENERATION`` exists, vLLM's ``LLMEngine.step`` returns no outputs
(after 0.1 s) instead of collecting them, so a call to ``VLLMEngine.generate`` keeps waiting and keeps asking the
run whether it is stopping (megareason/rollout/engine.py). The first held step writes ``<file>.seen`` (this
process's PID): the test signals the job, or kills the engine, once a generation is under way. Imported by
``sitecustomize`` in this folder only when the variable is set.
"""

import functools
import os
import time

from patch_on_import import patch_on_import

HOLD = os.environ["MEGAREASON_TEST_HOLD_GENERATION"]


def _hold(module) -> None:
    step = module.LLMEngine.step

    @functools.wraps(step)
    def held_step(self):
        if not os.path.exists(HOLD):
            return step(self)
        if not os.path.exists(HOLD + ".seen"):
            with open(HOLD + ".seen", "w") as f:
                f.write(f"{os.getpid()}\n")
        time.sleep(0.1)
        return []

    module.LLMEngine.step = held_step


patch_on_import({"vllm.v1.engine.llm_engine": _hold})
