"""The shipped envelope's keys for this torch release, earned again here by accelpact-qualify trials.

``make test`` runs this on every supported release (``make test-releases`` for the ones besides the pinned
one).  For each wrapping (FSDP1 on job.mesh, FSDP1 on job.groups, FSDP2 on job.mesh), accelpact-qualify
runs the shortened decoder job once uninterrupted and then three real boundary faults and three real
backward faults, each repaired in process and ending on the uninterrupted run's digest
(``scripts/earn_envelope.py``); a batch-norm model (the vision example's ``mobilenet``, FSDP1) goes through the
same trials and must earn the same keys.  The test fails when a trial fails on this release (the repair broke here),
when the shipped envelope lacks a key earned here, or when it holds one not earned again.
"""

from __future__ import annotations

import sys

import pytest

from accelpact_slurm.runtime.job import envelope as env_mod
from tests.conftest import load_script

pytestmark = pytest.mark.multiproc


def test_every_shipped_key_of_this_release_is_earned_again_by_real_trials(tmp_path, capsys):
    import torch

    earn = load_script("earn_envelope")
    release = env_mod.release_of(torch.__version__)
    assert release in env_mod.SUPPORTED_RELEASES, (
        f"torch {torch.__version__} is outside the supported releases {env_mod.SUPPORTED_RELEASES}")
    got, earned, failures = earn.earn(sys.executable, str(tmp_path), out=sys.stdout)
    assert got == release
    assert not failures, "\n".join(failures)
    assert len(earned.entries) == len(earn.WRAPPINGS) * len(env_mod.QUALIFIABLE_PHASES)
    for e in earned.entries:  # each key of each wrapping and phase, with the evidence of 3/3 trials
        assert e.actions == (env_mod.PRESERVE, env_mod.RESTART) and e.evidence["successes"] == env_mod.MIN_TRIALS, e
        assert e.key.platform == env_mod.platform_key(release, "gloo")
    gaps = earn.compare(release, earned, env_mod.load_file(env_mod.SHIPPED))
    assert not gaps, "\n".join(gaps)
    # the batch-norm model's trials (per-rank running statistics put back on a redo) earned the same keys
    batchnorm = env_mod.load_file(str(tmp_path / release / "envelope-batchnorm.yaml"))
    assert len(batchnorm.entries) == len(earn.BATCHNORM) * len(env_mod.QUALIFIABLE_PHASES)
    assert all(e.actions == (env_mod.PRESERVE, env_mod.RESTART) for e in batchnorm.entries), batchnorm.entries
    # Negative control: a batch-norm trial that failed (restart only recorded) takes the key from the earned ones.
    failed = env_mod.Envelope([env_mod.Entry(batchnorm.entries[0].key, (env_mod.RESTART,), {})])
    (gap,) = earn.batchnorm_gaps(release, earned, failed)
    assert "the batch-norm model earned restart" in gap and "the decoder preserve/restart" in gap, gap
    # Negative control: the comparison sees a shipped envelope without one of these keys, naming the release.
    cut = env_mod.Envelope(env_mod.load_file(env_mod.SHIPPED).entries[:])
    cut.entries = [e for e in cut.entries if e.key != earned.entries[0].key]
    (gap,) = earn.compare(release, earned, cut)
    assert gap.startswith(f"torch {release}: the shipped envelope has no entry for {earned.entries[0].key}")
