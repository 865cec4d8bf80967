"""Unit tests for accelpact_slurm.slurm.hostlist: Slurm node-list expansion and compression."""

from __future__ import annotations

import pytest

from accelpact_slurm.core.errors import AccelpactError, SlurmEnvError
from accelpact_slurm.slurm.hostlist import MAX_HOSTS, compress_hostlist, expand_hostlist


@pytest.mark.parametrize(
    ("hostlist", "expected"),
    [
        ("node1", ["node1"]),
        ("login", ["login"]),
        ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
        ("a[01-03]", ["a01", "a02", "a03"]),
        ("gpu[001-004]", ["gpu001", "gpu002", "gpu003", "gpu004"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("node[5]", ["node5"]),
        ("node[1-2],gpu[01-02],login", ["node1", "node2", "gpu01", "gpu02", "login"]),
        ("rack1-node[1-2].cluster", ["rack1-node1.cluster", "rack1-node2.cluster"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("[1-2]x", ["1x", "2x"]),
        ("node[3,1-2]", ["node3", "node1", "node2"]),
        ("my_host-a.b[0-1]", ["my_host-a.b0", "my_host-a.b1"]),
        ("  node[1-2]\n", ["node1", "node2"]),
        ("", []),
        ("   ", []),
    ],
)
def test_expand(hostlist: str, expected: list[str]) -> None:
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        ([], ""),
        (["node1"], "node1"),
        (["login"], "login"),
        (["node1", "node2", "node3"], "node[1-3]"),
        (["node1", "node2", "node3", "node7"], "node[1-3,7]"),
        (["gpu001", "gpu002", "gpu003", "gpu004"], "gpu[001-004]"),
        (["n9", "n10", "n11"], "n[9-11]"),
        (["n08", "n09", "n10"], "n[08-10]"),
        (["node1", "node2", "gpu01", "gpu02", "login"], "node[1-2],gpu[01-02],login"),
        (["rack1-node1.cluster", "rack1-node2.cluster"], "rack1-node[1-2].cluster"),
        (["r1n1", "r1n2", "r2n1", "r2n2"], "r1n[1-2],r2n[1-2]"),
        # Order is kept, so a descending list does not become one range.
        (["node3", "node2", "node1"], "node[3,2,1]"),
    ],
)
def test_compress(hosts: list[str], expected: str) -> None:
    assert compress_hostlist(hosts) == expected


@pytest.mark.parametrize(
    "hosts",
    [
        ["node1", "node2", "node3", "node7", "login", "node8"],
        ["a01", "a02", "a03"],
        ["a1", "a01", "a001", "a2", "a02"],  # mixed widths must not merge
        ["n9", "n10", "n010", "n11"],
        ["x0", "x00", "x000"],
        ["gpu003", "gpu001", "gpu002", "gpu004"],
        ["r1n1", "r1n2", "r2n1", "r2n2"],
        ["rack1-node1.cluster", "rack1-node2.cluster", "rack2-node1.cluster"],
        ["node1", "node1"],
        ["a", "b", "c"],
        [f"gpu{i:04d}" for i in range(1, 513)] + ["login"],
    ],
)
def test_round_trip_from_list(hosts: list[str]) -> None:
    assert expand_hostlist(compress_hostlist(hosts)) == hosts


@pytest.mark.parametrize(
    "hostlist",
    ["node[1-3,7]", "a[01-03]", "node[1-2],gpu[01-02],login", "rack1-node[1-2].cluster", "gpu[001-004]"],
)
def test_round_trip_from_string(hostlist: str) -> None:
    hosts = expand_hostlist(hostlist)
    assert expand_hostlist(compress_hostlist(hosts)) == hosts
    assert compress_hostlist(hosts) == hostlist


@pytest.mark.parametrize(
    "hostlist",
    [
        "node[1-3",
        "node1-3]",
        "node[[1-2]]",
        "node[3-1]",
        "node[]",
        "node[a-b]",
        "node[1-]",
        "node[-2]",
        "node[1,,2]",
        "node[1-2-3]",
        "node1,,node2",
        ",node1",
        "node1,",
        "node 1",
        "node1, node2",
        "node[1 -2]",
        "node$1",
        "node[1-2]x[",
    ],
)
def test_malformed_raises_naming_value(hostlist: str) -> None:
    with pytest.raises(SlurmEnvError) as info:
        expand_hostlist(hostlist)
    assert repr(hostlist) in str(info.value)


def test_descending_range_suggests_fix() -> None:
    with pytest.raises(SlurmEnvError, match=r"'03-01'.*'01-03'"):
        expand_hostlist("a[03-01]")


def test_too_many_hosts_raises() -> None:
    with pytest.raises(SlurmEnvError, match="more than"):
        expand_hostlist("node[1-999999999]")
    with pytest.raises(SlurmEnvError, match="more than"):
        expand_hostlist("r[1-1000]n[1-1000]")
    assert len(expand_hostlist(f"node[1-{MAX_HOSTS}]")) == MAX_HOSTS


@pytest.mark.parametrize("bad", ["", "node 1", "node[1]", "a,b", "x\ny"])
def test_compress_rejects_invalid_names(bad: str) -> None:
    with pytest.raises(SlurmEnvError) as info:
        compress_hostlist(["node1", bad])
    assert repr(bad) in str(info.value)


def test_error_is_catchable_as_value_error_and_ours() -> None:
    with pytest.raises(ValueError):
        expand_hostlist("node[")
    with pytest.raises(AccelpactError):
        expand_hostlist("node[")
