"""Tokenizers for `hspmd data prepare`: bytes, a byte-level BPE trained on the corpus, or a
`tokenizer.json` (Hugging Face `tokenizers`, which comes with `transformers`; `pip install
tokenizers` alone is enough).

Every tokenizer appends an end-of-document id to each document (bytes: 256; a BPE: its
`<|endoftext|>`; a given tokenizer: the first of its special tokens that means it, if any), so a
window across two documents shows where one ends.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import numpy as np

from hspmd.data.errors import DataError

__all__ = ["ByteTokenizer", "HFTokenizer", "make_tokenizer", "END_OF_DOCUMENT"]

#: the special token a trained BPE ends each document with
END_OF_DOCUMENT = "<|endoftext|>"
#: special tokens of given tokenizers taken as the end of a document, in this order
EOD_NAMES = (END_OF_DOCUMENT, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, 256 the end of a document: a vocabulary of 257."""

    name = "byte"
    vocab_size = 257
    eod = 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Return each text's ids (the end-of-document id last)."""
        return [np.append(np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int64), self.eod) for t in texts]

    def save(self, path: str) -> bool:
        """Write nothing: bytes need no tokenizer file. Return False."""
        return False


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("--tokenizer bpe:N and PATH.json need the Hugging Face tokenizers package: "
                        "pip install tokenizers (it comes with the torch extra: pip install 'hspmd[torch]')") from None
    return tokenizers


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (encodes without adding its own special tokens)."""

    def __init__(self, tokenizer, name: str) -> None:
        self.tokenizer, self.name = tokenizer, name
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.eod = next((int(vocab[t]) for t in EOD_NAMES if t in vocab), None)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        tail = [] if self.eod is None else [self.eod]
        return [np.asarray(e.ids + tail, dtype=np.int64) for e in encoded]

    def save(self, path: str) -> bool:
        """Write the tokenizer to `path` (tokenizer.json). Return True."""
        self.tokenizer.save(path)
        return True


def train_bpe(texts: Callable[[], Iterable[str]], vocab_size: int) -> HFTokenizer:
    """Return a byte-level BPE of at most `vocab_size` ids (the 256 byte symbols, `<|endoftext|>` and
    merges) trained on the texts `texts()` yields, offline."""
    tk = _tokenizers()
    if vocab_size < 257:
        raise DataError(f"--tokenizer bpe:{vocab_size}: a byte-level BPE needs a vocabulary of at least 257 "
                        "(256 bytes and the end of a document)")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_DOCUMENT], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts(), trainer)
    return HFTokenizer(tokenizer, "bpe")


def make_tokenizer(spec: str, texts: Callable[[], Iterable[str]]):
    """Return the tokenizer `--tokenizer spec` names: `byte`, `bpe:VOCAB` (trained on `texts()`), or
    the path of a `tokenizer.json`; DataError saying what is wrong otherwise."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            raise DataError(f"--tokenizer {spec}: expected bpe:VOCAB with VOCAB a number, e.g. bpe:8192") from None
        return train_bpe(texts, vocab)
    if spec.endswith(".json") or os.path.isfile(spec):
        tk = _tokenizers()
        try:
            return HFTokenizer(tk.Tokenizer.from_file(spec), "file")
        except FileNotFoundError:
            raise DataError(f"--tokenizer {spec}: no such file") from None
        except Exception as err:  # the library's own parse errors
            raise DataError(f"--tokenizer {spec}: not a tokenizers tokenizer.json ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''})") from None
    raise DataError(f"--tokenizer {spec}: expected byte, bpe:VOCAB or the path of a tokenizer.json")


def tokenizer_summary(index, directory: str) -> str:
    """Return what the dataset's tokenizer is, in a few words (for `hspmd data info`)."""
    if index.tokenizer_file:
        path = os.path.join(directory, index.tokenizer_file)
        try:
            with open(path, encoding="utf-8") as f:
                model = json.load(f).get("model", {}).get("type", "?")
        except (OSError, ValueError):
            model = "unreadable"
        return f"{index.tokenizer} ({model}, {index.tokenizer_file})"
    return index.tokenizer
