"""Packed, shuffled, resumable language-model batches from a 1-D token stream.

The stream is cut into ``num_blocks = (n - 1) // seq_len`` blocks; block ``i`` is the
``seq_len + 1`` tokens starting at ``i * seq_len`` (consecutive blocks share one boundary token,
so every token but the first is a target exactly once per epoch). A block gives
``inputs = block[:-1]`` and ``targets = block[1:]``.

Batch ``k`` (counting from 0 over the whole run) is a pure function of ``k`` and the seed:
epoch ``e = k // batches_per_epoch`` visits the blocks in the order of a permutation drawn
from a generator seeded by ``(seed, e)``, and the batch takes the next ``batch_size`` blocks
of that order (the remainder of an epoch that does not fill a batch is left out). So resuming
is indexing: ``batches(start=k)`` yields exactly what ``batches()`` yields after ``k`` batches,
and the only data state a checkpoint needs is the :class:`DataPosition`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from jaxtyping import Int
from torch import Tensor

__all__ = ["DataPosition", "PackedBatches", "held_out_split"]


class DataPosition(NamedTuple):
    """Where a run is in its data: a pytree of 0-d int64 tensors, for the checkpoint.

    Besides the number of batches consumed it records what that number means (seed, blocks,
    batch size, block length) so that a checkpoint resumed on other data fails loudly instead
    of silently reading other batches.
    """

    consumed: Tensor
    seed: Tensor
    num_blocks: Tensor
    batch_size: Tensor
    seq_len: Tensor


class PackedBatches:
    """Batches ``(inputs, targets)``, each ``int64 [batch_size, seq_len]``, from ``tokens``.

    With ``world_size > 1`` each rank gets its contiguous ``batch_size // world_size`` rows of
    every global batch (data parallelism: the global batch, and so the loss, is the same for
    any world size).
    """

    def __init__(
        self,
        tokens: Int[Tensor, " n"],
        *,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must be positive")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if batch_size % world_size:
            raise ValueError(
                f"batch_size ({batch_size}) must be divisible by world_size ({world_size})"
            )
        self.tokens = tokens
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device) if device is not None else tokens.device
        self.num_blocks = max(tokens.numel() - 1, 0) // seq_len
        self.batches_per_epoch = self.num_blocks // batch_size
        if self.batches_per_epoch == 0:
            need = batch_size * seq_len + 1
            raise ValueError(
                f"the corpus is too small: {tokens.numel()} tokens give {self.num_blocks} blocks "
                f"of {seq_len + 1}, a batch needs {batch_size} (at least {need} tokens)"
            )
        self._starts = torch.arange(seq_len + 1)
        #: The held-out batches of the same corpus (``text_batches(held_out=...)``), or None.
        self.held_out: PackedBatches | None = None
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    @property
    def tokens_per_batch(self) -> int:
        """Target tokens in one global batch."""
        return self.batch_size * self.seq_len

    def epoch_order(self, epoch: int) -> Tensor:
        """The permutation of block indices for ``epoch``."""
        if epoch != self._epoch:
            digest = hashlib.blake2b(f"{self.seed}:{epoch}".encode(), digest_size=8).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
            self._order = torch.randperm(self.num_blocks, generator=gen)
            self._epoch = epoch
        return self._order

    def batch(self, index: int) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
        """Batch number ``index`` of the run (this rank's rows)."""
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        epoch, i = divmod(index, self.batches_per_epoch)
        rows = self.batch_size // self.world_size
        first = i * self.batch_size + self.rank * rows
        blocks = self.epoch_order(epoch)[first:first + rows]
        cut = self.tokens[blocks[:, None] * self.seq_len + self._starts].to(torch.int64)
        cut = cut.to(self.device, non_blocking=True)
        return cut[:, :-1], cut[:, 1:]

    def batches(self, start: int | DataPosition = 0) -> Iterator[tuple[Tensor, Tensor]]:
        """Batches from ``start`` (a count of batches already consumed, or a position), forever."""
        index = self._check(start) if isinstance(start, DataPosition) else int(start)
        while True:
            yield self.batch(index)
            index += 1

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self.batches(0)

    def position(self, consumed: int) -> DataPosition:
        """The checkpointable position after ``consumed`` batches."""
        def t(v: int) -> Tensor:
            return torch.tensor(v, dtype=torch.int64)

        return DataPosition(t(consumed), t(self.seed), t(self.num_blocks), t(self.batch_size),
                            t(self.seq_len))

    def _check(self, pos: DataPosition) -> int:
        mine = self.position(0)
        for field in ("seed", "num_blocks", "batch_size", "seq_len"):
            saved, now = int(getattr(pos, field)), int(getattr(mine, field))
            if saved != now:
                raise ValueError(
                    f"the data position was saved with {field}={saved}, this loader has {now}: "
                    "resuming would read different batches"
                )
        return int(pos.consumed)


def held_out_split(tokens: Int[Tensor, " n"],
                   fraction: float) -> tuple[Int[Tensor, " n_train"], Int[Tensor, " n_held"]]:
    """``(train, held_out)``: the stream cut at ``n - ceil(fraction * n)``, the tail held out.

    A contiguous tail rather than sampled blocks: packed blocks of neighbouring text overlap in
    content (and consecutive blocks share a boundary token), so blocks drawn from one stream
    would leak training text into the evaluation. Cut here, no token position is in both: the
    training blocks read positions ``[0, cut)`` and the held-out ones ``[cut, n)``. A pure
    function of the stream and ``fraction``, so every rank and every resumed run cuts alike.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction!r}")
    n = tokens.numel()
    cut = n - math.ceil(fraction * n)
    return tokens[:cut], tokens[cut:]
