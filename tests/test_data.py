"""Corpus discovery, offline tokenizing through ``datasets``, packing, shuffling and resuming."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest
import torch

from funcpar.data import (
    BYTE_VOCAB_SIZE,
    DataPosition,
    PackedBatches,
    byte_tokenize,
    corpus_files,
    load_tokens,
    stdlib_files,
    text_batches,
    text_only,
)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test (and is recorded)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


def _write(root: Path, files: dict[str, str]) -> list[Path]:
    out = []
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        out.append(p)
    return out


def test_byte_tokenizer():
    text = "def f(x):\n    return 'é' + x\n"
    ids = byte_tokenize(text)
    assert bytes(ids).decode("utf-8") == text
    assert all(0 <= i < BYTE_VOCAB_SIZE for i in ids)
    assert len(ids) == len(text) + 1  # é is two bytes


def test_load_tokens_concatenates_files_in_order_offline(tmp_path, no_network):
    import datasets

    flags = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS)
    texts = {"b.txt": "second file\nwith two lines\n", "a.txt": "first ü\n", "c.txt": "x"}
    files = _write(tmp_path / "corpus", texts)
    tokens = load_tokens(files, cache_dir=tmp_path / "cache")
    assert tokens.dtype == torch.int32
    assert bytes(tokens.tolist()) == "".join(texts.values()).encode("utf-8")
    # The second load comes from the cache and is the same.
    assert torch.equal(load_tokens(files, cache_dir=tmp_path / "cache"), tokens)
    assert no_network == []
    assert (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS) == flags


def test_custom_tokenizer_and_eos(tmp_path, no_network):
    vocab = {"alpha": 1, "beta": 2, "gamma": 3}
    files = _write(tmp_path, {"a.txt": "alpha beta", "b.txt": "gamma alpha"})

    def words(text: str) -> list[int]:
        return [vocab[w] for w in text.split()]

    tokens = load_tokens(files, tokenizer=words, eos_id=0, cache_dir=tmp_path / "cache")
    assert tokens.tolist() == [1, 2, 0, 3, 1, 0]


def test_missing_and_empty_corpora(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        corpus_files(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        text_batches(missing, batch_size=2, seq_len=4)
    with pytest.raises(FileNotFoundError, match="gone.txt"):
        corpus_files([tmp_path / "gone.txt"])
    with pytest.raises(FileNotFoundError, match="gone.txt"):
        load_tokens([tmp_path / "gone.txt"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="no file matching"):
        corpus_files(tmp_path / "empty_dir")
    with pytest.raises(ValueError, match="empty"):
        corpus_files([])
    files = _write(tmp_path / "blank", {"a.txt": "", "b.txt": ""})
    with pytest.raises(ValueError, match="corpus is empty"):
        load_tokens(files, cache_dir=tmp_path / "cache")
    small = _write(tmp_path / "small", {"a.txt": "0123456789"})
    with pytest.raises(ValueError, match="too small"):
        text_batches(small[0], batch_size=2, seq_len=8, cache_dir=tmp_path / "cache")


def test_corpus_directory_glob(tmp_path):
    _write(tmp_path, {"b.txt": "b", "sub/a.txt": "a", "sub/skip.py": "p", ".hidden/x.txt": "h"})
    assert [p.relative_to(tmp_path).as_posix() for p in corpus_files(tmp_path)] == [
        "b.txt", "sub/a.txt"]
    assert [p.name for p in corpus_files(tmp_path, "**/*.py")] == ["skip.py"]
    assert corpus_files(tmp_path / "b.txt") == [tmp_path / "b.txt"]


def test_binary_corpus_files_are_skipped_with_a_warning_or_refused(tmp_path, no_network):
    texts = {"a.txt": "first text file\n" * 4, "c.txt": "second, with é\n" * 4}
    _write(tmp_path / "corpus", texts)
    (tmp_path / "corpus" / "b.txt").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")  # NUL bytes
    (tmp_path / "corpus" / "d.txt").write_bytes("latin-1 é\n".encode("latin-1"))  # not UTF-8
    with pytest.warns(UserWarning, match=r"skipped 2 corpus file\(s\).*b\.txt.*NUL.*d\.txt.*"
                                         r"not utf-8"):
        loader = text_batches(tmp_path / "corpus", batch_size=2, seq_len=8,
                              cache_dir=tmp_path / "cache")
    assert bytes(loader.tokens.tolist()) == "".join(texts.values()).encode("utf-8")
    with pytest.raises(ValueError, match=r"corpus file '.*b\.txt' is not text: binary \(a NUL "
                                         r"byte at offset 8\)"):
        text_batches(tmp_path / "corpus", batch_size=2, seq_len=8, on_binary="error",
                     cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"no text file remains.*all 1 file\(s\).*d\.txt"):
        load_tokens([tmp_path / "corpus" / "d.txt"], cache_dir=tmp_path / "cache")


def test_text_check_reads_in_chunks(tmp_path, monkeypatch):
    """A character cut by a chunk boundary is text; a bad byte is placed exactly."""
    import funcpar.data.corpus as corpus

    monkeypatch.setattr(corpus, "_CHUNK", 3)
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("abé€x", encoding="utf-8")  # é (2 bytes) and € (3 bytes) across chunks
    bad.write_bytes("abé€".encode() + b"\xff!")
    assert text_only([good]) == [good]
    with pytest.raises(ValueError, match=r"not utf-8 text \(byte offset 7\)"):
        text_only([good, bad], on_binary="error")
    # TypeError: under the tests' type-checking import hook the Literal refuses it first.
    with pytest.raises((ValueError, TypeError), match="on_binary"):
        text_only([good], on_binary="keep")


def test_stdlib_corpus_is_deterministic_and_bounded():
    files = stdlib_files(300_000)
    assert files == stdlib_files(300_000)
    assert files and sum(p.stat().st_size for p in files) <= 300_000
    assert all(p.suffix == ".py" and p.is_file() for p in files)
    assert not any({"test", "tests", "site-packages"} & set(p.parts) for p in files)
    # A larger budget extends the same order.
    more = stdlib_files(600_000)
    assert more[: len(files)] == files and len(more) > len(files)
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_files(0)


def _stream(n: int = 1000) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)).to(torch.int32)


def test_packing_covers_the_stream_once_per_epoch():
    tokens = _stream(103)
    loader = PackedBatches(tokens, batch_size=3, seq_len=10, seed=1)
    assert loader.num_blocks == 10 and loader.batches_per_epoch == 3
    seen = []
    for x, y in itertools.islice(loader, 3):
        assert x.shape == y.shape == (3, 10) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
        for row_x, row_y in zip(x, y):
            start = [i for i in range(10) if torch.equal(tokens[i * 10:i * 10 + 10].long(),
                                                         row_x)]
            assert len(start) == 1
            assert torch.equal(tokens[start[0] * 10 + 1:start[0] * 10 + 11].long(), row_y)
            seen.append(start[0])
    # 9 distinct blocks of 10: the epoch's last block does not fill a batch and is left out.
    assert len(set(seen)) == 9


def test_shuffle_is_deterministic_per_seed_and_epoch():
    tokens = _stream()
    a = PackedBatches(tokens, batch_size=4, seq_len=8, seed=5)
    b = PackedBatches(tokens, batch_size=4, seq_len=8, seed=5)
    c = PackedBatches(tokens, batch_size=4, seq_len=8, seed=6)
    assert torch.equal(a.epoch_order(0), b.epoch_order(0))
    assert not torch.equal(a.epoch_order(0), c.epoch_order(0))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))
    assert sorted(a.epoch_order(1).tolist()) == list(range(a.num_blocks))
    for (xa, ya), (xb, yb) in zip(itertools.islice(a, 70), itertools.islice(b, 70)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("k", [0, 1, 29, 30, 31, 95])
def test_resume_equals_skipping(k):
    """From position k (also across epoch boundaries: 30 batches an epoch) the batches are
    those of an uninterrupted run after k batches, also through a DataPosition."""
    tokens = _stream()
    loader = PackedBatches(tokens, batch_size=4, seq_len=8, seed=3)
    assert loader.batches_per_epoch == 31
    straight = list(itertools.islice(loader.batches(), k + 5))[k:]
    fresh = PackedBatches(tokens, batch_size=4, seq_len=8, seed=3)
    for start in (k, fresh.position(k)):
        resumed = list(itertools.islice(fresh.batches(start), 5))
        for (x0, y0), (x1, y1) in zip(straight, resumed):
            assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_position_is_checkpointable_and_checked():
    tokens = _stream()
    loader = PackedBatches(tokens, batch_size=4, seq_len=8, seed=3)
    pos = loader.position(7)
    assert isinstance(pos, DataPosition)
    assert all(t.dtype == torch.int64 and t.dim() == 0 for t in pos)
    other = PackedBatches(tokens, batch_size=4, seq_len=8, seed=4)
    with pytest.raises(ValueError, match="seed=3, this loader has 4"):
        next(other.batches(pos))
    shorter = PackedBatches(tokens[:500], batch_size=4, seq_len=8, seed=3)
    with pytest.raises(ValueError, match="num_blocks"):
        next(shorter.batches(pos))


def test_ranks_split_the_global_batch():
    tokens = _stream()
    whole = PackedBatches(tokens, batch_size=6, seq_len=8, seed=2)
    parts = [PackedBatches(tokens, batch_size=6, seq_len=8, seed=2, rank=r, world_size=3)
             for r in range(3)]
    for k in (0, 1, 20):
        x, y = whole.batch(k)
        xs = [p.batch(k) for p in parts]
        assert torch.equal(torch.cat([a for a, _ in xs]), x)
        assert torch.equal(torch.cat([b for _, b in xs]), y)
    with pytest.raises(ValueError, match="divisible by world_size"):
        PackedBatches(tokens, batch_size=6, seq_len=8, world_size=4)
    with pytest.raises(ValueError, match="rank 3"):
        PackedBatches(tokens, batch_size=6, seq_len=8, rank=3, world_size=3)


def test_text_batches_on_the_stdlib(tmp_path, no_network):
    loader = text_batches(batch_size=2, seq_len=32, seed=0, max_bytes=200_000,
                          cache_dir=tmp_path / "cache")
    x, y = loader.batch(0)
    assert x.shape == (2, 32) and int(x.max()) < BYTE_VOCAB_SIZE
    assert torch.equal(x[:, 1:], y[:, :-1])
    expected = b"".join(p.read_bytes() for p in stdlib_files(200_000))
    assert loader.tokens.numel() == len(expected)
    assert no_network == []
