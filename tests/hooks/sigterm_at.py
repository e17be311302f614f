"""A SIGTERM to the driver at a named phase of a step, for the pre-emption test at colocated rollout TP 2
(tests/test_train_e2e.py).

``MEGAREASON_TEST_SIGTERM_AT=PHASE:N`` names the phase and which of this run's passes through it: the Nth
``generation`` (a sampled generate, between two engine steps), ``logprobs`` (a log-prob pass, before its first piece
after a micro-batch), ``train`` (a stoppable training pass, likewise), ``sync`` (a weight sync, the resume's
included), ``validation`` (a greedy generate, between two engine steps) or ``save`` (a role's checkpoint
write). There, the policy's rank 0 sends SIGTERM to the driver (its PID is in the run folder's ``.lock``,
``MEGAREASON_TEST_SIGTERM_RUN``) and waits for the driver's stop file before it goes on, so the stop reaches the
ranks at that point of the step and not later. Imported by ``sitecustomize`` in this folder only when the
variable is set.
"""

import functools
import os
import signal
import time

from patch_on_import import patch_on_import

AT = os.environ["MEGAREASON_TEST_SIGTERM_AT"]
RUN = os.environ["MEGAREASON_TEST_SIGTERM_RUN"]
PHASE, NTH = AT.split(":")[0], int(AT.split(":")[1])
seen: dict[str, int] = {}
fired = []


def _rank0() -> bool:
    return os.environ.get("RANK") == "0"


def _reach(phase: str) -> bool:
    """Count a pass through ``phase``; True when it is the one to stop in."""
    seen[phase] = seen.get(phase, 0) + 1
    return phase == PHASE and seen[phase] == NTH and _rank0() and not fired


def _fire(where: str) -> None:
    """SIGTERM to the driver; ``where`` (e.g. "engine step 1", "piece 3 of 8") goes to the file
    ``<run folder>.fired`` beside the run folder, for the test to compare with where the stop took effect."""
    fired.append(1)
    with open(RUN.rstrip(os.sep) + ".fired", "a") as f:
        f.write(f"{AT} {where}\n")
    with open(os.path.join(RUN, ".lock")) as f:
        pid = int(f.read().split()[1])  # "pid N on HOST, since ..."
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 60
    while not os.path.exists(os.path.join(RUN, ".stopping")) and time.time() < deadline:
        time.sleep(0.05)


def _patch(module) -> None:
    name = module.__name__
    if name == "megareason.rollout.colocated":
        cls = module.ColocatedEngine
        generate, look = cls.generate, cls._stop_now

        @functools.wraps(generate)
        def counted_generate(self, prompts, sampling, use_tqdm=True):
            self._test_phase = "generation" if sampling.temperature > 0 else "validation"
            self._test_due = _reach(self._test_phase)
            return generate(self, prompts, sampling, use_tqdm=use_tqdm)

        @functools.wraps(look)
        def stop_now(self, steps):
            if getattr(self, "_test_due", False) and steps >= 1:
                self._test_due = False
                _fire(f"engine step {steps}")
                self._polled = float("-inf")  # look at the stop file at the next agreement
            return look(self, steps)

        cls.generate, cls._stop_now = counted_generate, stop_now
    elif name == "megareason.models.schedule":
        check = module._check

        @functools.wraps(check)
        def checked(stop, what, parts, i, n):
            done = parts[i].indices(n)[0]
            if stop is not None and done > 0 and not getattr(checked, "counted", None) == id(stop):
                checked.counted = id(stop)  # one count per pass, before its first piece after a micro-batch
                if _reach("logprobs" if "log-prob" in what else "train"):
                    _fire(f"piece {i + 1} of {len(parts)}")
            return check(stop, what, parts, i, n)

        module._check = checked
    elif name == "megareason.trainer.workers":
        sync = module.PolicyWorker.sync_weights

        @functools.wraps(sync)  # the driver calls a worker's method by its name
        def synced(self):
            if _reach("sync"):
                _fire("sync")
            return sync(self)

        module.PolicyWorker.sync_weights = synced
    elif name == "megareason.models.roles":
        save = module._Trainable.save

        @functools.wraps(save)
        def saved(self, *args, **kwargs):
            if _reach("save"):
                _fire("save")
            return save(self, *args, **kwargs)

        module._Trainable.save = saved


patch_on_import(dict.fromkeys(("megareason.rollout.colocated", "megareason.models.schedule",
                               "megareason.trainer.workers", "megareason.models.roles"), _patch))
