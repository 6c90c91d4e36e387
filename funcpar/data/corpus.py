"""Which local files make a text corpus.

The default corpus needs no download: the Python standard library's own source files, found
through ``sysconfig``. A user corpus is a file, a directory (its files matching a glob) or a list
of files. Every path is checked here, so a typo fails before any tokenizing with a message that
names it.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_STDLIB_BYTES", "corpus_files", "stdlib_files"]

#: Enough text for thousands of small-model steps, small enough to tokenize in seconds.
DEFAULT_STDLIB_BYTES = 4 << 20

# Tests hold deliberately odd files (bad encodings, invalid syntax); site-packages is not the
# standard library and changes with every install.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__"})


def stdlib_files(max_bytes: int = DEFAULT_STDLIB_BYTES) -> list[Path]:
    """A deterministic subset of the standard library's ``*.py`` files, at most ``max_bytes``.

    Files are taken in the order of a hash of their path relative to the library root (so the
    subset spans the whole library rather than its alphabetical head) until the next file would
    pass ``max_bytes``; the same Python installation always gives the same list.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library directory {root} does not exist")
    rel = []
    # os.walk with the skipped directories pruned, not rglob + filter: site-packages alone can
    # hold more files than the whole standard library.
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        base = Path(top).relative_to(root)
        rel.extend(base / n for n in names if n.endswith(".py"))
    rel.sort(key=lambda r: hashlib.blake2b(r.as_posix().encode(), digest_size=8).digest())
    chosen, total = [], 0
    for r in rel:
        size = (root / r).stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(root / r)
        total += size
    if not chosen:
        raise ValueError(f"no standard-library file fits in max_bytes={max_bytes}")
    return chosen


def corpus_files(
    corpus: str | Path | Sequence[str | Path], pattern: str = "**/*.txt"
) -> list[Path]:
    """The files of ``corpus``: a file, a directory (its files matching ``pattern``, sorted,
    hidden ones skipped) or a sequence of files.

    Raises FileNotFoundError naming a path that does not exist and ValueError when a directory
    holds no matching file.
    """
    if isinstance(corpus, (str, Path)):
        path = Path(corpus).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"corpus path {str(path)!r} does not exist")
        if path.is_file():
            return [path]
        files = sorted(
            p for p in path.glob(pattern)
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(f"corpus directory {str(path)!r} holds no file matching {pattern!r}")
        return files
    files = [Path(p).expanduser() for p in corpus]
    if not files:
        raise ValueError("the corpus file list is empty")
    for p in files:
        if not p.is_file():
            raise FileNotFoundError(f"corpus file {str(p)!r} does not exist or is not a file")
    return files
