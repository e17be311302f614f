"""What a rollout engine's vLLM rank received in each weight update, for the tests that compare it with the
trainer's exported checkpoint (tests/test_async_rollouts.py).

With ``MEGAREASON_TEST_RECORD_WEIGHTS=DIR``, every weight update through ``megareason.rollout.vllm_worker._Reload``
(the colocated path, the tmpfs and the broadcast backends) writes ``DIR/<pid>-<n>.json`` once it has finished:
the n-th update of that vLLM process, ``{HF name: [dtype, shape, sha256 of the bytes]}`` of each tensor as it
reached ``load_weights``. Imported by ``sitecustomize`` in this folder only when the variable is set.
"""

import functools
import json
import os

from patch_on_import import patch_on_import
from weight_digest import digest

DIR = os.environ["MEGAREASON_TEST_RECORD_WEIGHTS"]


def _record(module) -> None:
    cls, updates = module._Reload, []
    begin, load, finish = cls.begin, cls.load, cls.finish

    @functools.wraps(begin)
    def begun(self):
        self._test_received = {}
        return begin(self)

    @functools.wraps(load)
    def loaded(self, names, tensors):
        self._test_received.update({n: digest(t) for n, t in zip(names, tensors, strict=True)})
        return load(self, names, tensors)

    @functools.wraps(finish)
    def finished(self):
        out = finish(self)
        updates.append(1)
        path = os.path.join(DIR, f"{os.getpid()}-{len(updates)}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self._test_received, f)
        os.replace(path + ".tmp", path)
        return out

    cls.begin, cls.load, cls.finish = begun, loaded, finished


patch_on_import({"megareason.rollout.vllm_worker": _record})
