"""Tokenizers for ``steadytrain data ingest``: bytes, or a Hugging Face ``tokenizers`` JSON file.

Both turn a list of documents into one concatenated array of token ids with the end-of-document
token after each document, in the smallest unsigned integer type that holds the vocabulary.

* ``bytes``: a token is a byte value (0..255); the end-of-document token is 256, the vocabulary 257.
* a ``tokenizers`` JSON file (``tokenizer.json``): loaded with ``Tokenizer.from_str``, never
  downloaded. The end-of-document token is the tokenizer's own special token (``<|endoftext|>``,
  ``</s>``, ``<|end_of_text|>``, ``<eos>``, ``<|eos|>``, ``[SEP]``, the first one it has), else a new
  id one past the vocabulary (which grows by one). Truncation and padding saved in the file are
  turned off (a document is never cut short) and special tokens are not added around documents.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from steadytrain._io import brief, read_text, write_text_atomic
from steadytrain.data.sources import IngestError
from steadytrain.errors import UserError

__all__ = [
    "BYTES",
    "EOD_CANDIDATES",
    "TOKENIZER_FILE",
    "ByteTokenizer",
    "FileTokenizer",
    "load_tokenizer",
    "token_dtype",
]

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"
"""A ``tokenizers`` file given to ingest, kept in the dataset under this name (its sha256 is in the provenance)."""
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
MAX_TOKENIZER_BYTES = 256 * 2**20  # the largest public tokenizer.json files are a few tens of MB


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id below ``vocab_size``.

    Example:
        >>> str(token_dtype(256)), str(token_dtype(257)), str(token_dtype(70_000))
        ('uint8', 'uint16', 'uint32')
    """
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise IngestError(f"a vocabulary of {vocab_size} tokens does not fit in 32 bits")


class _Tokenizer:
    """What both tokenizers share: the dtype, the provenance record, :meth:`encode`."""

    name: str
    sha256: str | None
    vocab_size: int
    eod: int

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer type that holds the vocabulary."""
        return token_dtype(self.vocab_size)

    def provenance(self) -> dict[str, Any]:
        """``{name, vocab_size, sha256, eod}`` as recorded in the dataset's provenance."""
        return {"name": self.name, "vocab_size": self.vocab_size, "sha256": self.sha256, "eod": self.eod}

    def encode(self, docs: Sequence[Any], ends: Sequence[bool] | None = None) -> np.ndarray:
        """The documents' tokens, concatenated, with the end-of-document token after each one that ``ends``
        (default: every one; a large file is encoded in pieces and only its last piece ends its document)."""
        return self.encode_counts(docs, ends)[0]

    def encode_counts(self, docs: Sequence[Any], ends: Sequence[bool] | None = None) -> tuple[np.ndarray, list[int]]:
        """:meth:`encode`, and the number of tokens of each document (its end-of-document token included)."""
        raise NotImplementedError


class ByteTokenizer(_Tokenizer):
    """A token per byte (0..255); end of document 256.

    Example:
        >>> ByteTokenizer().encode([b"hi", "é"]).tolist()
        [104, 105, 256, 195, 169, 256]
    """

    name = BYTES
    sha256 = None
    vocab_size = 257
    eod = 256
    needs_text = False  # bytes are tokenized as they are: no UTF-8 decoding, nothing to get wrong

    def encode_counts(
        self, docs: Sequence[bytes | str], ends: Sequence[bool] | None = None
    ) -> tuple[np.ndarray, list[int]]:
        eod = np.array([self.eod], dtype=self.dtype)
        parts, counts = [], []
        for i, doc in enumerate(docs):
            parts.append(np.frombuffer(doc.encode("utf-8") if isinstance(doc, str) else doc, dtype=np.uint8))
            counts.append(len(parts[-1]))
            if ends is None or ends[i]:
                parts.append(eod)
                counts[-1] += 1
        return (np.concatenate(parts, dtype=self.dtype) if parts else np.empty(0, self.dtype)), counts

    def worker_copy(self) -> ByteTokenizer:
        return self

    def save(self, directory: Path) -> None:
        """Bytes need no file: the provenance says it all."""


class FileTokenizer(_Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer loaded from its JSON text; see :func:`load_tokenizer`."""

    needs_text = True

    def __init__(self, name: str, text: str):
        from tokenizers import Tokenizer

        self.name, self._text = name, text
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        try:
            tok = Tokenizer.from_str(text)
        except Exception as err:  # the Rust side raises a bare Exception naming the missing part
            raise IngestError(
                f"--tokenizer {name}: not a Hugging Face tokenizers file ({brief(str(err))}): "
                "name a tokenizer.json saved by `tokenizers` or `transformers`, or use --tokenizer bytes"
            ) from None
        tok.no_truncation()  # a truncation saved in the file would cut every document short
        tok.no_padding()
        self._tok = tok
        added = tok.get_added_tokens_decoder()
        specials = {t.content: i for i, t in added.items() if t.special}
        size = max(tok.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        found = next((specials[c] for c in EOD_CANDIDATES if c in specials), None)
        self.eod = found if found is not None else size
        self.vocab_size = size if found is not None else size + 1

    def encode_counts(self, docs: Sequence[str], ends: Sequence[bool] | None = None) -> tuple[np.ndarray, list[int]]:
        if not docs:
            return np.empty(0, self.dtype), []
        ids = [e.ids for e in self._tok.encode_batch(list(docs), add_special_tokens=False)]
        eod = [self.eod]
        flat = [x for i, seq in enumerate(ids) for x in ((seq, eod) if ends is None or ends[i] else (seq,))]
        counts = [len(seq) + (ends is None or ends[i]) for i, seq in enumerate(ids)]
        tokens = np.fromiter(itertools.chain.from_iterable(flat), dtype=self.dtype, count=sum(counts))
        return tokens, counts

    def save(self, directory: Path) -> None:
        """Keep the file, as read, in the dataset ``directory`` (``tokenizer.json``): the tokenizer that gives
        the data's ids, for a model trained on them (``export --format hf`` writes it out)."""
        write_text_atomic(directory / TOKENIZER_FILE, self._text)

    def worker_copy(self) -> FileTokenizer:
        """The same tokenizer loaded afresh in a worker process, with the library's own threads off
        (``TOKENIZERS_PARALLELISM=false``): the workers are the parallelism, and a forked copy of a
        tokenizer that has used its threads can deadlock."""
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        return FileTokenizer(self.name, self._text)


def load_tokenizer(spec: str | os.PathLike[str] = BYTES) -> ByteTokenizer | FileTokenizer:
    """``"bytes"``, or the ``tokenizers`` JSON file at ``spec`` (read from disk, never downloaded).

    Raises:
        IngestError: the file is missing, not a file, not UTF-8 (a binary file) or not a tokenizer.

    Example:
        >>> t = load_tokenizer("bytes"); t.vocab_size, t.eod, str(t.dtype)
        (257, 256, 'uint16')
    """
    if os.fspath(spec) == BYTES:
        return ByteTokenizer()
    path = Path(spec)
    try:
        text = read_text(path, what="tokenizer file", max_bytes=MAX_TOKENIZER_BYTES)
    except UserError as err:
        raise IngestError(f"--tokenizer {err}: name a tokenizer.json, or use --tokenizer bytes") from None
    return FileTokenizer(path.name, text)
