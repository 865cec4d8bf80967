"""The benchmark parts behind ``benchmarks/parts/*.py`` (the entry scripts are thin wrappers).

- ``harness``: what every part shares (command line, statistics, results, launching ranks);
- ``workload``: the one place the benchmarks import the reference workload (``examples/decoder/``) from;
- ``ckpt_*``: the checkpoint-service benchmark (``benchmarks/parts/ckpt.py``);
- ``repair_*``: the L1 repair benchmark (``benchmarks/parts/repair.py``);
- ``peers_*``: ours against torchft and nvidia-resiliency-ext (``benchmarks/parts/peers.py``; the peers'
  own workers stay in ``benchmarks/parts/peers_workers/``, they run in the peers' virtual environments);
- ``shared_entry``: the ranks of the shared-tier benchmark (``benchmarks/parts/shared.py``: the cost of uploads);
- ``*_entry.py``: how a part's code enters the ranks ``accelpact-run``'s launcher starts: each is an entry
  point ``main(job)`` written against the public API (``job.protect``, ``run.update()``), named by the
  ``entry:`` of the job file the part writes, with the part's plan in that file's ``params.bench``.
"""
