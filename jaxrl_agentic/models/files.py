"""The package's cache folder and the two file-system guards every cached model uses.

`cache_dir()` is `$JAXRL_AGENTIC_CACHE`, else `$XDG_CACHE_HOME/jaxrl_agentic`, else
`~/.cache/jaxrl_agentic`; built models, converted GGUF files, fetched packages and warm-ups
live under it. `file_lock` makes concurrent builders of one cached folder take turns;
`directory_written_whole` makes a crash leave no half-written folder behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile


class CheckpointError(ValueError):
    """A model's files are missing something or do not fit the architecture (a Hugging Face
    directory, a GGUF file, a packaged model): the entry points print it as one line."""


def cache_dir() -> str:
    root = os.environ.get("JAXRL_AGENTIC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxrl_agentic"
    )
    return root


@contextlib.contextmanager
def file_lock(path: str):
    """Holds an exclusive lock on the file `path` (across processes): callers that build the
    same cached directory take turns, and the later ones find it built."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def directory_written_whole(path: str):
    """A scratch directory beside ``path`` to write into; on success it replaces ``path``
    (renamed into place), on any error it is removed: ``path`` is never half-written."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-save-", dir=parent)
    try:
        yield tmp
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
