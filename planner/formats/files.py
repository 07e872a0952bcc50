"""Writing files so that a crash never leaves half of one: plans, profiles, checkpoints."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes the file at a temporary path beside `path` (same name, so the same
    suffix), which is then renamed into place; on failure nothing changes at `path`."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmpdir = tempfile.mkdtemp(dir=directory, prefix=".dapple-")
    try:
        tmp = os.path.join(tmpdir, os.path.basename(path))
        write(tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def write_text_atomically(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    write_atomically(path, write)
