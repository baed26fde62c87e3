"""Tokenize a list of texts once and cache the result on disk.

A split is stored as one flat int32 tensor of token ids plus row offsets (`TokenizedTexts`), which
is compact and loads in milliseconds. The cache key covers the texts themselves (their hash), the
tokenizer's full definition, `max_length` and whether special tokens are added, so a change to any
of them re-tokenizes and nothing stale is ever read. Files are written to a temporary name and
renamed, so an interrupted run never leaves a half-written cache entry.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from bertaccel.errors import DataError
from bertaccel.pretrained import tokenizer_fingerprint

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    root = Path(os.environ.get("BERTACCEL_CACHE", Path.home() / ".cache" / "bertaccel"))
    if root.exists() and not root.is_dir():
        raise DataError(f"the cache directory {root} (BERTACCEL_CACHE) is a file; point BERTACCEL_CACHE at a "
                        "directory (it is created if missing).")
    return root


def ids_digest(ids: torch.Tensor, offsets: torch.Tensor) -> str:
    h = hashlib.sha256(ids.numpy().tobytes())
    h.update(offsets.numpy().tobytes())
    return h.hexdigest()


def _checked(d: dict, n_texts: int, vocab_size: int, path: Path) -> TokenizedTexts:
    """A cache entry as read, after checking it is the one written for these texts: shape, offsets,
    id range and the digest stored with it (a damaged or edited entry is re-made, never trained on)."""
    ids, offsets = d["ids"], d["offsets"]
    problems = []
    if offsets.numel() != n_texts + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
        problems.append("row offsets do not fit the texts")
    elif bool((offsets[1:] < offsets[:-1]).any()):
        problems.append("row offsets go backwards")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        problems.append(f"token ids outside 0..{vocab_size - 1}")
    if "digest" not in d:
        problems.append("written by an older bertaccel, without a digest")
    elif d["digest"] != ids_digest(ids, offsets):
        problems.append("contents differ from what was written")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return TokenizedTexts(ids, offsets)


@dataclass
class TokenizedTexts:
    """Token ids of N texts: row i is `ids[offsets[i]:offsets[i + 1]]`."""

    ids: torch.Tensor  # (total_tokens,) int32
    offsets: torch.Tensor  # (N + 1,) int64

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]


def texts_hash(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def tokenize_texts(
    texts: list[str],
    tokenizer,
    max_length: int | None,
    add_special_tokens: bool = True,
    cache_dir: str | os.PathLike | None = None,
    batch: int = 2048,
) -> TokenizedTexts:
    """Token ids for `texts`, truncated to `max_length`, read from the cache when present."""
    key = hashlib.sha256(
        f"{texts_hash(texts)}|{tokenizer_fingerprint(tokenizer)}|{max_length}|{add_special_tokens}".encode()
    ).hexdigest()[:24]
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "tokenized" / f"{key}.pt"
    vocab_size = len(tokenizer)
    if path.is_file():
        try:
            tokenized = _checked(torch.load(path, weights_only=True), len(texts), vocab_size, path)
            log.info("tokenized data read from cache %s", path)
            return tokenized
        except Exception as e:  # noqa: BLE001 - a damaged cache entry is re-made, never trusted
            log.warning("bertaccel: cache entry %s is not usable (%s); tokenizing again", path, str(e)[:200])
    chunks, lengths = [], []
    for start in range(0, len(texts), batch):
        enc = tokenizer(
            texts[start : start + batch],
            truncation=max_length is not None,
            max_length=max_length,
            add_special_tokens=add_special_tokens,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
        for ids in enc:
            chunks.append(torch.tensor(ids, dtype=torch.int32))
            lengths.append(len(ids))
    ids = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int32)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"ids": ids, "offsets": offsets, "digest": ids_digest(ids, offsets)}, tmp)
        os.replace(tmp, path)
    except OSError as e:  # read-only or full cache: train anyway, without the cache
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        log.warning("bertaccel: could not write the tokenization cache %s (%s); continuing without it "
                    "(set BERTACCEL_CACHE to a writable directory).", path.parent, e.strerror or e)
        return TokenizedTexts(ids, offsets)
    log.info("tokenized %d texts (%d tokens), cached at %s", len(texts), ids.numel(), path)
    return TokenizedTexts(ids, offsets)
