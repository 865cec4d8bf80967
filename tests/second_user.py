"""A real second local user for the tests of what another user can plant: ``nobody`` (created with ``useradd``
where this machine lacks one), and a way to run code as her.  Needs root."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from typing import Iterator

import pytest

OTHER = "nobody"
ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="a second local user needs root to set up")


def other_user() -> pwd.struct_passwd:
    """The second user's entry, creating her where she is missing."""
    try:
        return pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER],
                       check=True, timeout=60)
        return pwd.getpwnam(OTHER)


def as_other(user: pwd.struct_passwd, code: str) -> None:
    """Run ``code`` in a process of the second user's (what it creates is hers)."""
    script = f"import os\nos.setgid({user.pw_gid}); os.setuid({user.pw_uid})\n" + textwrap.dedent(code)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, cwd="/")


def shared_tmp() -> Iterator[str]:
    """A folder in /tmp the second user may enter (not list): pytest's own folders are closed to her."""
    d = tempfile.mkdtemp(prefix="accelpact-test-safeopen-")
    os.chmod(d, 0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
