"""Text data: local corpora, tokenized through Hugging Face ``datasets``, packed into
deterministic, resumable language-model batches.

``datasets`` is an optional extra (``funcpar[data]``), imported only when text is loaded;
packing and corpus discovery work without it.
"""

from funcpar.data.corpus import DEFAULT_STDLIB_BYTES, corpus_files, stdlib_files, text_only
from funcpar.data.packing import DataPosition, PackedBatches, held_out_split
from funcpar.data.text import (
    BYTE_VOCAB_SIZE,
    Tokenizer,
    byte_tokenize,
    load_tokens,
    rank0_first,
    text_batches,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DEFAULT_STDLIB_BYTES",
    "DataPosition",
    "PackedBatches",
    "Tokenizer",
    "byte_tokenize",
    "corpus_files",
    "held_out_split",
    "load_tokens",
    "rank0_first",
    "stdlib_files",
    "text_batches",
    "text_only",
]
