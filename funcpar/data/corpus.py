"""Which local files make a text corpus.

The default corpus needs no download: the Python standard library's own source files, found
through ``sysconfig``. A user corpus is a file, a directory (its files matching a glob) or a list
of files. Every path is checked here, so a typo fails before any tokenizing with a message that
names it, and so is every file's content (:func:`text_only`): a binary file among the text is
skipped with a warning naming it, or refused.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

__all__ = ["DEFAULT_STDLIB_BYTES", "corpus_files", "stdlib_files", "text_only"]

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


OnBinary = Literal["skip", "error"]
_CHUNK = 1 << 20


def _not_text(path: Path, encoding: str) -> str | None:
    """Why ``path`` is not text in ``encoding`` (a NUL byte, an undecodable byte), or None.

    Read in chunks through an incremental decoder: one pass over the bytes, no decoded copy
    of a large file kept.
    """
    decoder = codecs.getincrementaldecoder(encoding)()
    offset = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            # NUL is valid UTF-8, but no text file holds one: it marks a binary file.
            if (nul := chunk.find(b"\0")) >= 0:
                return f"binary (a NUL byte at offset {offset + nul})"
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the last chunk
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                return f"not {encoding} text (byte offset {offset - pending + err.start})"
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return f"not {encoding} text (it ends inside a character)"
    return None


def text_only(
    files: Sequence[str | Path], *, encoding: str = "utf-8", on_binary: OnBinary = "skip"
) -> list[Path]:
    """``files`` without those that are not text: holding a NUL byte or not ``encoding``.

    ``on_binary="skip"`` (the default: a source tree routinely holds a stray binary, and
    leaving it out loses nothing meant as text) drops them with one warning naming them;
    ``"error"`` raises ValueError naming the first. Raises ValueError too when no file is left.
    """
    if on_binary not in ("skip", "error"):
        raise ValueError(f"on_binary must be 'skip' or 'error', got {on_binary!r}")
    kept, skipped = [], []
    for f in map(Path, files):
        why = _not_text(f, encoding)
        if why is None:
            kept.append(f)
        elif on_binary == "error":
            raise ValueError(f"corpus file {str(f)!r} is not text: {why}")
        else:
            skipped.append(f"{str(f)!r} ({why})")
    if skipped and not kept:
        raise ValueError(f"no text file remains in the corpus: all {len(skipped)} file(s) are "
                         f"binary or not {encoding}: " + ", ".join(skipped[:5])
                         + (", ..." if len(skipped) > 5 else ""))
    if skipped:
        warnings.warn(f"skipped {len(skipped)} corpus file(s) that are not text: "
                      + ", ".join(skipped), stacklevel=3)
    return kept
