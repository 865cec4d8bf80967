"""The launch part's timing hook: a training script run as ``__main__`` with every optimizer step of this rank
timed, the same way under plain ``torchrun`` and under ``accelpact-run`` (``-m benchmarks.parts.launch_timer
SCRIPT.py [its args]``, both launchers' module form).

Two of torch's public global optimizer hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` and
``..._post_hook``) record ``time.perf_counter()`` as every ``optimizer.step()`` begins (``pre``: before any hook of
the optimizer itself; under ``accelpact-run`` before the update's vote) and as it returns (``post``: after every
hook of the optimizer); a pre-hook of the optimizer's own, added at its first step after the ones it has
(``register_step_pre_hook``), records ``mid``: the optimizer's pre-hooks (the vote) done, its step about to run.
Each mark is ``[wall, cpu, process_cpu]``: ``time.perf_counter()``, the training thread's CPU time
(``time.thread_time()``) and the whole process's (``time.process_time()``: every thread of the rank), so that a
segment that takes longer can be told apart as more work (CPU) or as waiting (for peers, or for a core).
One update is the interval from one step's return to the next one's: its zero_grad, the end of the update (the
protected run's commit), the next batch, forward, backward and the step.  When the script returns the rank writes
``$ACCELPACT_BENCH_UPDATE_TIMES/rank-<RANK>.json`` (``{"rank", "pre", "mid", "post", "threads", ...}``).  The
script sees the ``sys.argv`` and ``sys.path`` either launcher gives a script run directly: ``[SCRIPT.py, its
args]``, its directory first.  Nothing of the product is touched: the hooks are torch's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from typing import Any

#: Where every rank writes its times (a directory; set by the launch part).
TIMES_VAR = "ACCELPACT_BENCH_UPDATE_TIMES"


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m benchmarks.parts.launch_timer SCRIPT.py [its args]")
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    out = os.environ[TIMES_VAR]
    marks: dict[str, list[list[float]]] = {"pre": [], "mid": [], "post": []}
    hooked: set[int] = set()

    def mark(where: str) -> None:  # wall clock, this thread's CPU, the whole process's CPU
        marks[where].append([time.perf_counter(), time.thread_time(), time.process_time()])

    def at_mid(_opt: Any, _args: Any, _kwargs: Any) -> None:
        mark("mid")

    def at_pre(opt: Any, _args: Any, _kwargs: Any) -> None:
        mark("pre")
        if id(opt) not in hooked:  # after the optimizer's own pre-hooks, from its first step on
            hooked.add(id(opt))
            hooks.append(opt.register_step_pre_hook(at_mid))

    def at_post(_opt: Any, _args: Any, _kwargs: Any) -> None:
        mark("post")

    hooks: list[Any] = [register_optimizer_step_pre_hook(at_pre), register_optimizer_step_post_hook(at_post)]
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        for hook in hooks:
            hook.remove()
        rank = int(os.environ.get("RANK", "0"))
        os.makedirs(out, exist_ok=True)
        tmp = os.path.join(out, f".rank-{rank}.json.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"rank": rank, **marks, "threads": torch.get_num_threads(),
                       "interop_threads": torch.get_num_interop_threads(),
                       "deterministic": torch.are_deterministic_algorithms_enabled()}, fh)
        os.replace(tmp, os.path.join(out, f"rank-{rank}.json"))


if __name__ == "__main__":
    main()
