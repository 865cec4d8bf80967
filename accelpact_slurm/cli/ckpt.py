"""``accelpact-ckpt list|verify|export``: a node's snapshots from the shell.

- ``list DIR``: the snapshots of a node directory (or a run directory: every node), state, size, age;
- ``verify PATH``: checksums and coverage of one snapshot, or of every snapshot of a node
  directory; records verified/rejected and prints the newest verified;
- ``export SNAPSHOT OUT [--format torch|safetensors]``: one verified snapshot as one file: the whole snapshot
  for ``torch.load`` (as stock ``dcp_to_torch_save`` converts it), or the model's weights and persistent buffers
  for ``safetensors``; buffers rank 0's in both, whichever node's copy (:mod:`ckpt_service.export`).

Exit 0 when every verified snapshot passed (or the export was written), 1 when one was rejected (or the
export refused), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from typing import Sequence

from ckpt_service.export import FORMATS, export_snapshot
from ckpt_service.index import newest_verified, read_record, record_state, scan
from ckpt_service.layout import step_of
from accelpact_slurm.core.errors import CheckpointError
from ckpt_service.auth import find_run_dir, load_key
from ckpt_service.verify import check_checksums, verify_snapshot


def _node_dirs(path: str) -> list[str]:
    """A node directory, or every ``node-local/*`` of a run directory."""
    local = os.path.join(path, "node-local")
    if os.path.isdir(local):
        return [os.path.join(local, n) for n in sorted(os.listdir(local))]
    return [path]


def cmd_list(args) -> int:
    rows = []
    for nd in _node_dirs(args.path):
        for r in scan(nd):
            rows.append({"node": os.path.basename(nd), **r.to_json()})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no snapshots under {args.path}")
        return 0
    now = time.time()
    print(f"{'node':<10} {'step':>10} {'state':<10} {'size':>12} {'age':>8}  reason")
    for r in rows:
        print(f"{r['node']:<10} {r['step']:>10} {r['state']:<10} {r['size_bytes']:>12} "
              f"{now - r['created']:>7.0f}s  {r['reason'] or ''}")
    return 0


def _key(args, path: str) -> bytes | None:
    """The run's key (from --run-dir, else the nearest run directory above ``path``); None with a message."""
    run_dir = args.run_dir or find_run_dir(path)
    if run_dir is None:
        print(f"accelpact-ckpt: no run key (.accelpact-key) in or above {path}: pass --run-dir RUN_DIR; nothing of "
              f"a snapshot is read before its manifest is authenticated", file=sys.stderr)
        return None
    try:
        return load_key(run_dir)
    except CheckpointError as exc:
        print(f"accelpact-ckpt: {exc}", file=sys.stderr)
        return None


def cmd_verify(args) -> int:

    key = _key(args, args.path)
    if key is None:
        return 2
    targets = [args.path] if step_of(args.path) is not None else [r.path for nd in _node_dirs(args.path)
                                                                   for r in scan(nd)]
    failed = 0
    for p in targets:
        ok, why = verify_snapshot(p, key)
        before = read_record(p)
        if ok and before is not None and before.state == "rejected" and not args.force:
            # a snapshot the replay check rejected passes its checksums (they compare it with itself)
            ok, why = False, f"stays rejected ({before.reason}); --force records verified anyway"
        elif args.record:
            record_state(p, "verified" if ok else "rejected", None if ok else why)
        failed += not ok
        print(f"{'verified' if ok else 'REJECTED'}  {p}: {why}")
    if step_of(args.path) is None:
        for nd in _node_dirs(args.path):
            best, why = newest_verified(scan(nd))
            print(f"newest verified in {nd}: {best.path if best else None} ({why})")
    return 1 if failed else 0


def cmd_export(args) -> int:

    if read_record(args.snapshot) is None:
        print(f"accelpact-ckpt: {args.snapshot} is not a step-NNNNNNNNNN snapshot", file=sys.stderr)
        return 2
    key = _key(args, args.snapshot)
    if key is None:
        return 2
    try:  # the manifest is authenticated before anything of the snapshot is unpickled
        line = export_snapshot(args.snapshot, args.out, args.format, key)
    except CheckpointError as exc:
        print(f"accelpact-ckpt: refusing to export {args.snapshot}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"accelpact-ckpt: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(line)
    return 0


EXPORT_HELP = """Export one verified snapshot (a step-NNNNNNNNNN directory, in a node directory or the shared
tier) as one file. Only a snapshot recorded verified is exported, and only after its manifest is
authenticated under the run's key, every file matches its checksum and every tensor is covered:
committed, rejected or foreign snapshots are refused.

formats:
""" + "\n".join(textwrap.fill(what, 100, initial_indent=f"  {name:<13}", subsequent_indent=" " * 15)
               for name, what in FORMATS.items()) + """

The format defaults to safetensors when OUT ends in .safetensors, else torch.

documentation: docs/checkpoints.md#export"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="accelpact-ckpt", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                epilog="documentation: docs/checkpoints.md#from-the-shell")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("list", help="list snapshots")
    a.add_argument("path", metavar="DIR", help="a node directory or a run directory")
    a.add_argument("--json", action="store_true")
    a.set_defaults(fn=cmd_list)
    v = sub.add_parser("verify", help="verify snapshots (checksums and coverage; no model needed)")
    v.add_argument("path", metavar="PATH", help="a step-NNNNNNNNNN directory, a node directory or a run directory")
    v.add_argument("--no-record", dest="record", action="store_false", help="do not write state.json")
    v.add_argument("--force", action="store_true",
                   help="record verified even for a snapshot rejected before (e.g. by the replay check)")
    v.add_argument("--run-dir", metavar="DIR", help="the run directory whose key authenticates the manifests "
                                                    "(default: the nearest one above PATH)")
    v.set_defaults(fn=cmd_verify)
    e = sub.add_parser("export", help="one verified snapshot as one torch.save or safetensors file",
                       description=EXPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("snapshot", metavar="SNAPSHOT", help="a step-NNNNNNNNNN directory")
    e.add_argument("out", metavar="OUT", help="the file to write (e.g. model.safetensors, snapshot.pt)")
    e.add_argument("--format", choices=sorted(FORMATS), default=None,
                   help="torch: the whole snapshot for torch.load; safetensors: the model's weights only "
                        "(default: from OUT's suffix)")
    e.add_argument("--run-dir", metavar="DIR", help="the run directory whose key authenticates the manifest "
                                                    "(default: the nearest one above SNAPSHOT)")
    e.set_defaults(fn=cmd_export)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
