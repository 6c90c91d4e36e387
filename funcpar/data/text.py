"""Local text files to one stream of token ids, through Hugging Face ``datasets``.

Each file is one document (the ``text`` builder with ``sample_by="document"``), tokenized by
any ``str -> list[int]`` callable (bytes by default) in a cached ``Dataset.map``, then all
documents are concatenated in file order into a 1-D tensor that :mod:`funcpar.data.packing`
cuts into blocks.

Loading is offline by construction: the files are local and ``datasets`` is told so for the
duration of the call (it would otherwise send a usage-count request to the Hub for the builder,
which here waits out a timeout). ``datasets`` is an optional extra (``pip install funcpar[data]``)
and is imported only when text is loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from jaxtyping import Int
from torch import Tensor

from funcpar.data.corpus import (
    DEFAULT_STDLIB_BYTES,
    OnBinary,
    corpus_files,
    stdlib_files,
    text_only,
)
from funcpar.data.packing import PackedBatches, held_out_split

__all__ = ["BYTE_VOCAB_SIZE", "Tokenizer", "byte_tokenize", "load_tokens", "rank0_first",
           "text_batches"]

Tokenizer = Callable[[str], list[int]]
T = TypeVar("T")

#: Byte-level tokens are the 256 byte values.
BYTE_VOCAB_SIZE = 256


def byte_tokenize(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as ids 0..255 (no special tokens, nothing out of vocabulary)."""
    return list(text.encode("utf-8"))


def _import_datasets():
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError(
            "funcpar.data needs Hugging Face datasets: pip install 'funcpar[data]'"
        ) from err
    return datasets


@contextlib.contextmanager
def _offline(datasets) -> Iterator[None]:
    """``datasets`` offline, quiet, and without its Hub telemetry, restored afterwards.

    The flags are read from ``datasets.config`` at call time, so setting them here works even
    when ``datasets`` was imported before (the environment variables are read only at import).
    """
    cfg, bars = datasets.config, datasets.utils
    saved = {k: getattr(cfg, k) for k in
             ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_UPDATE_DOWNLOAD_COUNTS")}
    cfg.HF_HUB_OFFLINE = cfg.HF_DATASETS_OFFLINE = True
    cfg.HF_UPDATE_DOWNLOAD_COUNTS = False
    # The bars are silenced only when the user has not chosen through the environment.
    hush = cfg.HF_DATASETS_DISABLE_PROGRESS_BARS is None and not bars.are_progress_bars_disabled()
    if hush:
        bars.disable_progress_bars()
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)
        if hush:
            bars.enable_progress_bars()


def load_tokens(
    files: Sequence[str | Path],
    *,
    tokenizer: Tokenizer = byte_tokenize,
    eos_id: int | None = None,
    cache_dir: str | Path | None = None,
    encoding: str = "utf-8",
    on_binary: OnBinary = "skip",
) -> Int[Tensor, " n"]:
    """All ``files`` tokenized and concatenated in order, as a 1-D int32 (or int64) tensor.

    ``eos_id``, when given, is appended after every document. ``cache_dir`` is where
    ``datasets`` keeps its Arrow files (its own default, ``~/.cache/huggingface/datasets``, when
    None); a second load of unchanged files with the same tokenizer reads them from there.
    A file that is not text (a NUL byte, not ``encoding``) is skipped with a warning naming it,
    or refused with ``on_binary="error"`` (:func:`~funcpar.data.corpus.text_only`). Raises
    ValueError when the files hold no text at all.
    """
    if not files:
        raise ValueError("no corpus files given")
    files = [str(Path(f).expanduser().resolve()) for f in files]
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"corpus file {f!r} does not exist or is not a file")
    # Checked here, where the encoding is known: datasets' text builder would otherwise stop
    # on the first undecodable file with a traceback, and take a NUL-filled binary as text.
    files = [str(f) for f in text_only(files, encoding=encoding, on_binary=on_binary)]
    datasets = _import_datasets()
    with _offline(datasets):
        docs = datasets.load_dataset(
            "text",
            data_files=files,
            split="train",
            sample_by="document",
            encoding=encoding,
            cache_dir=None if cache_dir is None else str(cache_dir),
        )

        def tokenize(batch):  # a datasets LazyBatch of documents
            ids = [tokenizer(text) for text in batch["text"]]
            if eos_id is not None:
                ids = [x + [eos_id] for x in ids]
            return {"ids": ids}

        ids = docs.map(tokenize, batched=True, remove_columns=["text"], desc=None)
    return _concatenate(ids.data.column("ids"), files)


def _concatenate(column, files: list[str]) -> Int[Tensor, " n"]:
    import pyarrow.compute as pc  # a dependency of datasets

    flat = pc.list_flatten(column)
    if len(flat) == 0:
        shown = files[:3] + (["..."] if len(files) > 3 else [])
        raise ValueError(f"the corpus is empty: no tokens in {len(files)} file(s) {shown}")
    values = torch.from_numpy(flat.to_numpy(zero_copy_only=False).copy())
    if values.min() < 0:
        raise ValueError(f"the tokenizer produced a negative id ({int(values.min())})")
    # int32 halves the memory of a large corpus; batches are cast to int64 when cut.
    return values.to(torch.int32) if values.max() < 2**31 else values.to(torch.int64)


def text_batches(
    corpus: str | Path | Sequence[str | Path] | None = None,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    tokenizer: Tokenizer = byte_tokenize,
    eos_id: int | None = None,
    cache_dir: str | Path | None = None,
    pattern: str = "**/*.txt",
    max_bytes: int = DEFAULT_STDLIB_BYTES,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str | None = None,
    on_binary: OnBinary = "skip",
    held_out: float = 0.0,
) -> PackedBatches:
    """Corpus to batches in one call.

    ``corpus=None`` is the standard-library corpus (:func:`~funcpar.data.corpus.stdlib_files`,
    at most ``max_bytes``); otherwise a file, a directory (files matching ``pattern``) or a list
    of files. The remaining arguments are those of :func:`load_tokens` (``on_binary``: skip a
    file that is not text, with a warning, or refuse it) and
    :class:`~funcpar.data.packing.PackedBatches`.

    ``held_out`` > 0: that fraction of the token stream, its tail, is kept out of training
    (:func:`~funcpar.data.packing.held_out_split`: no token position in both) and packed as
    the returned loader's ``held_out`` (a :class:`PackedBatches` of the same shapes and seed,
    every rank's rows whole); 0 keeps the whole stream for training (``held_out`` None).
    """
    files = stdlib_files(max_bytes) if corpus is None else corpus_files(corpus, pattern)
    tokens = load_tokens(files, tokenizer=tokenizer, eos_id=eos_id, cache_dir=cache_dir,
                         on_binary=on_binary)
    held = None
    if held_out:
        tokens, rest = held_out_split(tokens, held_out)
        held = PackedBatches(rest, batch_size=batch_size, seq_len=seq_len, seed=seed,
                             device=device)
    loader = PackedBatches(tokens, batch_size=batch_size, seq_len=seq_len, seed=seed,
                           rank=rank, world_size=world_size, device=device)
    loader.held_out = held
    return loader


def rank0_first(load: Callable[[], T]) -> T:
    """``load()`` on every rank of the default process group, rank 0 first: the others wait
    at a barrier until it is done and then read ``datasets``' cache, rather than every rank
    tokenizing the same files at once. Without a group (one process), just ``load()``. Had
    rank 0 failed, its error ends the run (torchrun stops the ranks waiting here)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return load()
    out = load() if dist.get_rank() == 0 else None
    dist.barrier()
    return out if out is not None else load()
