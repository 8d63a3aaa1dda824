"""The tokenizer of an ``hf:`` run's data: kept in the run directory, written out by ``export --format hf``.

``steadytrain data ingest`` records its tokenizer in the dataset's provenance (``{name, vocab_size, sha256,
eod}``) and keeps a ``tokenizers`` JSON file it was given as ``tokenizer.json`` in the dataset. A run of an
``hf:`` model keeps, as ``hf_tokenizer.json``, the ``tokenizers`` JSON that gives the ids ingest gave:

* bytes: a byte-level tokenizer (GPT-2's byte-to-character alphabet, no merges): id ``b`` for byte ``b``,
  and ``<|endoftext|>`` = 256, the end of a document (a text holding that literal string gets id 256 too,
  as with GPT-2's own tokenizer);
* a ``tokenizers`` file: as ingest used it: truncation and padding off, no special tokens added around a
  text (a post-processor that adds some is dropped), and the end-of-document token ingest added past the
  vocabulary where the file had none.

The export writes it as ``tokenizer.json`` with a ``tokenizer_config.json`` naming the config's
``eos_token_id`` and ``bos_token_id`` tokens, so ``AutoTokenizer.from_pretrained`` loads it. Data without a
tokenizer in its provenance (shards written with ``DatasetWriter``, the built-in corpus) keeps none.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from steadytrain._io import brief, read_text
from steadytrain.data.format import open_dataset
from steadytrain.data.tokenize import BYTES, MAX_TOKENIZER_BYTES, TOKENIZER_FILE, ByteTokenizer
from steadytrain.errors import UserError

__all__ = ["RUN_FILE", "byte_tokenizer", "run_tokenizer", "tokenizer_files"]

RUN_FILE = "hf_tokenizer.json"
"""The run's tokenizer (``tokenizers`` JSON), kept in the run directory."""
EOD_TOKEN = "<|endoftext|>"
EXPORT_FILES = ("tokenizer.json", "tokenizer_config.json")

log = logging.getLogger(__name__)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value (``tokenizers``' ``ByteLevel`` alphabet), by byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_tokenizer() -> Any:
    """The ``tokenizers`` tokenizer of ``--tokenizer bytes``: byte ``b`` is id ``b``; ``<|endoftext|>`` is 256."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(EOD_TOKEN) == ByteTokenizer.eod
    return tok


def _as_ingested(text: str, eod: int) -> Any:
    """The tokenizer of ``text`` as ingest used it (see the module), or None where its ids cannot be kept."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(text)
    tok.no_truncation()
    tok.no_padding()
    if tok.encode("a b", add_special_tokens=True).ids != tok.encode("a b", add_special_tokens=False).ids:
        tok.post_processor = None  # ingest never added them: the model has not seen them around a document
    if tok.id_to_token(eod) is None:  # ingest's own end of document, one past the vocabulary
        free = [c for c in (EOD_TOKEN, "<|end_of_document|>", "<|steadytrain_eod|>") if tok.token_to_id(c) is None]
        if not free:
            return None
        tok.add_special_tokens([AddedToken(free[0], special=True, normalized=False)])
        if tok.token_to_id(free[0]) != eod:
            return None
    return tok


def run_tokenizer(data: Path | None) -> str | None:
    """The ``tokenizers`` JSON giving the ids the dataset at ``data`` was ingested with; None where its
    provenance names no tokenizer, or where the file cannot be found (a warning says why)."""
    if data is None:
        return None
    record = open_dataset(data).provenance.get("tokenizer")
    if not isinstance(record, dict) or not isinstance(record.get("eod"), int):
        return None
    if record.get("name") == BYTES:
        return byte_tokenizer().to_str()
    path = Path(data) / TOKENIZER_FILE
    why = None
    try:
        text = read_text(path, what="tokenizer file", max_bytes=MAX_TOKENIZER_BYTES)
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != record.get("sha256"):
            why = f"{path} is not the tokenizer the provenance names (sha256 {brief(record.get('sha256'))})"
        elif (tok := _as_ingested(text, record["eod"])) is None:
            why = f"{path} cannot give its end-of-document token the id {record['eod']}"
    except UserError as err:
        why = f"{err} (data ingested before steadytrain kept its tokenizer: ingest it again to keep one)"
    except Exception as err:  # the Rust side raises a bare Exception
        why = f"{path}: not a tokenizers file ({brief(str(err))})"
    if why is not None:
        log.warning("export --format hf of this run will write no tokenizer: %s", why)
        return None
    return tok.to_str()


def _token(tok: Any, ids: Any) -> str | None:
    """The content of the first of ``ids`` (an id or a list, as configs hold them) the tokenizer has."""
    for i in ids if isinstance(ids, list) else [ids]:
        if isinstance(i, int) and not isinstance(i, bool) and (content := tok.id_to_token(i)) is not None:
            return content
    return None


def tokenizer_files(text: str, config: dict[str, Any]) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the run's tokenizer ``text`` for the model ``config``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(text)
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key in ("bos", "eos"):
        if (content := _token(tok, config.get(f"{key}_token_id"))) is not None:
            settings[f"{key}_token"] = content
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(settings, indent=2, sort_keys=True) + "\n"}
