"""Hooks the end-to-end tests put into the runs they start (the driver, its Ray workers, vLLM's processes).

Python imports ``sitecustomize`` at start-up from the first folder of ``sys.path`` that has one: a test puts
this folder first on the run's ``PYTHONPATH``. Each hook acts only when its variable is set:

- ``MEGAREASON_TEST_HOLD_GENERATION``: a generation that lasts until it is stopped (``hold_generation.py``);
- ``MEGAREASON_TEST_SIGTERM_AT``: a SIGTERM to the driver at a named phase of a step (``sigterm_at.py``);
- ``MEGAREASON_TEST_RECORD_WEIGHTS``: what each vLLM rank received in each weight update (``record_weights.py``).

Then the next ``sitecustomize`` on ``sys.path`` runs as well, which Python itself would skip: the suite run as
an AVX2-only CPU runs it (``tools/avx2_only`` on ``PYTHONPATH``), so these runs stay restricted too.
"""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("MEGAREASON_TEST_HOLD_GENERATION"):
    import hold_generation  # noqa: F401
if os.environ.get("MEGAREASON_TEST_SIGTERM_AT"):
    import sigterm_at  # noqa: F401
if os.environ.get("MEGAREASON_TEST_RECORD_WEIGHTS"):
    import record_weights  # noqa: F401


def _run_the_next_one() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    later = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_the_next_one()
