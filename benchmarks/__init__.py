"""The benchmarks of AccelPact-Slurm: a project of its own beside the product, never imported by it.

- ``harness/``: ``run`` (``make bench``: runs the parts, writes their summaries, renders ``docs/benchmarks.md``
  and the README's figures from the summaries alone), ``summary`` (what a part's committed summary holds),
  ``common`` (statistics, timing, launching a part's job, reading its event log), ``env`` (the environment
  record), ``figures``/``docs_tables`` (the README's bullets, the goals' lines, the tables);
- ``parts/``: one module per part (``python -m benchmarks.parts.<part>``), their entry points inside the job's
  ranks (``*_entry.py``, written against the public API and ``accelpact_slurm.runtime.job.instrument``), the peers'
  workers (``parts/peers_workers/``, run in the peers' own venvs);
- ``summaries/``: the committed summaries, per run and part; raw results stay outside git (``runs/bench/``).
"""
