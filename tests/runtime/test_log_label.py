"""A rank's log records carry its rank unless whoever collects its output labels it already.  Pure (in-process
logging, the root logger's handlers put back)."""

from __future__ import annotations

import io
import logging

import pytest

from accelpact_slurm.runtime.job.entry import label_log_records


@pytest.fixture
def root_stream():
    root = logging.getLogger()
    saved = root.handlers[:]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    try:
        yield stream
    finally:
        root.handlers = saved


def test_every_line_of_a_record_carries_the_rank_once(root_stream):
    label_log_records(3, {})
    label_log_records(3, {})  # a second call does not label twice
    log = logging.getLogger("accelpact_slurm.test")
    log.warning("first line\nsecond line")
    assert root_stream.getvalue().splitlines() == ["[rank 3] WARNING accelpact_slurm.test: first line",
                                                   "[rank 3] second line"]


def test_output_labelled_already_leaves_the_records_as_they_were(root_stream):
    label_log_records(3, {"ACCELPACT_OUTPUT_LABELLED": "1"})
    logging.getLogger("ckpt_service.test").warning("plain")
    assert root_stream.getvalue() == "WARNING ckpt_service.test: plain\n"
