"""A generation that lasts until it is stopped, for the live pre-emption test (tests/test_nemo_run.py).

Python imports ``sitecustomize`` at start-up from the first folder of ``sys.path`` that has one: the test puts
this folder on the job's ``PYTHONPATH`` (which reaches the driver, its Ray workers and vLLM). While the file
named by ``MEGAREASON_TEST_HOLD_GENERATION`` exists, vLLM's ``LLMEngine.step`` returns no outputs (after
0.1 s) instead of collecting them, so a call to ``VLLMEngine.generate`` keeps waiting, as a long generation
of a large model does, and keeps asking the run whether it is stopping (megareason/rollout/engine.py). The
first held step writes ``<file>.seen``: the test signals the job once a generation is under way. Without the
variable this module does nothing.
"""

import os
import sys

HOLD = os.environ.get("MEGAREASON_TEST_HOLD_GENERATION")
TARGET = "vllm.v1.engine.llm_engine"

if HOLD:
    import importlib.abc
    import importlib.util
    import time

    def _hold(module) -> None:
        step = module.LLMEngine.step

        def held_step(self):
            if not os.path.exists(HOLD):
                return step(self)
            if not os.path.exists(HOLD + ".seen"):
                with open(HOLD + ".seen", "w") as f:
                    f.write(f"{os.getpid()}\n")
            time.sleep(0.1)
            return []

        module.LLMEngine.step = held_step

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        """Finds ``TARGET`` as the other finders do, and patches it once its code ran."""

        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _hold(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())
