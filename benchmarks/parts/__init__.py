"""The benchmark parts: ``<part>.py`` is what ``make bench`` runs (``python -m benchmarks.parts.<part> --json RAW``);
a part too large for one module keeps its pieces beside it as ``<part>_*.py``.

- ``workload``: the one place the benchmarks import the reference workload (``examples/decoder/``) from;
- ``campaign``: the fault campaign (``scripts/campaign.py`` through its command line), summarized per kind;
- ``peers_workers/``: the workers of torchft and nvidia-resiliency-ext, run in the peers' virtual environments;
- ``*_entry.py``: how a part's code enters the ranks ``accelpact-run``'s launcher starts: each is an entry
  point ``main(job)`` written against the public API (``job.protect``, ``run.update()``) and the product's
  instrumentation hooks (``accelpact_slurm.runtime.job.instrument``), named by the ``entry:`` of the job file the part
  writes, with the part's plan in that file's ``params.bench``.
"""
