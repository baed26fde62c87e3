"""Read raw rows (text + optional label) from local files or from the Hugging Face Hub.

Local files are parsed here rather than through `datasets.load_dataset("json", ...)` so that a
malformed row is reported with its file and line number. Formats: `.jsonl`, `.jsonl.gz`, `.csv`,
`.csv.gz`, `.parquet` for labelled data; additionally `.txt`, `.raw` (and `.gz` of them) for plain
text, one document per line.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from bertaccel.errors import DataError

TABLE_SUFFIXES = (".jsonl", ".jsonl.gz", ".csv", ".csv.gz", ".parquet")
TEXT_SUFFIXES = (".txt", ".raw", ".txt.gz", ".raw.gz", ".tokens", ".tokens.gz")
SPLIT_ALIASES = {
    "train": ("train",),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test",),
}


@dataclass
class RawSplit:
    """Texts and (for labelled data) integer labels of one split, with where they came from."""

    texts: list[str]
    labels: list[int] | None
    origin: str
    # For local files: (file, line) of each row, so later checks can point at the row.
    locations: list[tuple[str, int]] | None = field(default=None, repr=False)


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for s in TABLE_SUFFIXES + TEXT_SUFFIXES:
        if name.endswith(s):
            return s
    return path.suffix.lower()


def looks_like_path(name: str) -> bool:
    """A path rather than a Hub name: it starts like one (./, /, ~), or its first component is a local
    directory (`data/imdb` when ./data exists), or it has more than one slash."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return True
    head = name.split("/", 1)[0]
    return "/" in name and os.path.isdir(head)


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def _not_utf8(path: Path, line: int, raw: bytes | None, e: UnicodeDecodeError, near: bool = False) -> str:
    where = f"{path}:{line}" if not near else f"{path}, near line {line}"
    column = f" at column {e.start + 1}" if raw is not None else ""
    return (f"{where}: not UTF-8 text (byte 0x{e.object[e.start]:02x}{column}). Re-save the file as UTF-8 "
            "(e.g. `iconv -f latin1 -t utf-8 in > out`).")


def find_split_file(directory: Path, split: str, suffixes=TABLE_SUFFIXES,
                    hint: str = "Keep one file per split in the folder (move the others elsewhere).") -> Path | None:
    """The file for `split` in `directory` (`train.jsonl.gz`, `wiki.valid.raw`, `dev.csv`, ...);
    `hint` ends the error when several files match (what the caller's options allow)."""
    candidates = []
    for p in sorted(directory.iterdir()):
        if not p.is_file() or _suffix(p) not in suffixes:
            continue
        stem = p.name[: -len(_suffix(p))].lower()
        parts = stem.replace("-", ".").replace("_", ".").split(".")
        if any(alias in parts for alias in SPLIT_ALIASES[split]):
            candidates.append(p)
    if len(candidates) > 1:
        raise DataError(
            f"{directory} has several files for the '{split}' split: {[c.name for c in candidates]}. {hint}"
        )
    return candidates[0] if candidates else None


def read_table(path: str | os.PathLike, text_column: str = "text", label_column: str | None = "label") -> RawSplit:
    """Read a labelled (or, with `label_column=None`, unlabelled) table file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist. Check the path in `data.dataset`.")
    suffix = _suffix(path)
    texts: list[str] = []
    labels: list[int] | None = [] if label_column else None
    locations: list[tuple[str, int]] = []

    def add(row: dict, line: int) -> None:
        where = f"{path}:{line}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with a '{text_column}' field, got {type(row).__name__}.")
        if text_column not in row:
            raise DataError(
                f"{where}: no '{text_column}' field (fields: {sorted(row)}). "
                f"Set `data.text_column` to the column that holds the text."
            )
        text = row[text_column]
        if not isinstance(text, str):
            raise DataError(f"{where}: '{text_column}' must be a string, got {type(text).__name__}.")
        if not text.strip():
            raise DataError(f"{where}: empty text. Remove the row or fill in its text.")
        if labels is not None:
            if label_column not in row:
                raise DataError(
                    f"{where}: no '{label_column}' field (fields: {sorted(row)}). "
                    f"Set `data.label_column` to the column that holds the label."
                )
            label = row[label_column]
            if isinstance(label, str) and label.strip().lstrip("-").isdigit():
                label = int(label)
            if isinstance(label, bool) or not isinstance(label, int):
                fix = (" Map the names to 0..K-1 in the data and list them, one per line in index order, in "
                       "classes.txt next to the data files." if isinstance(label, str) else "")
                raise DataError(f"{where}: label {label!r} is not an integer class index.{fix}")
            labels.append(label)
        texts.append(text)
        locations.append((str(path), line))

    if suffix in (".jsonl", ".jsonl.gz"):
        with _open_binary(path) as f:
            for i, raw_line in enumerate(f, start=1):
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(_not_utf8(path, i, raw_line, e)) from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{i}: not valid JSON ({e.msg}). Each line must be one JSON object.") from None
                add(row, i)
    elif suffix in (".csv", ".csv.gz"):
        with _open_text(path) as f:
            reader = csv.DictReader(f)
            try:
                for row in reader:
                    add(row, reader.line_num)
            except UnicodeDecodeError as e:
                raise DataError(_not_utf8(path, reader.line_num + 1, None, e, near=True)) from None
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for i, row in enumerate(table.to_pylist(), start=1):
            add(row, i)
    else:
        raise DataError(f"{path}: unsupported file type. Use one of {', '.join(TABLE_SUFFIXES)}.")
    if not texts:
        raise DataError(f"{path} has no rows.")
    return RawSplit(texts, labels, str(path), locations)


def read_text_documents(path: str | os.PathLike, text_column: str = "text") -> list[str]:
    """Documents for language modelling: one per non-blank line of a text file, or per row of a table."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"text file {path} does not exist. Check `data.train_files` / `data.val_files` / `data.dataset`.")
    if _suffix(path) in TABLE_SUFFIXES:
        return read_table(path, text_column=text_column, label_column=None).texts
    if _suffix(path) not in TEXT_SUFFIXES:
        raise DataError(f"{path}: unsupported file type. Use one of {', '.join(TEXT_SUFFIXES + TABLE_SUFFIXES)}.")
    with _open_text(path) as f:
        docs = [line.strip() for line in f if line.strip()]
    if not docs:
        raise DataError(f"{path} has no text.")
    return docs


def load_hub_dataset(name: str, config: str | None = None):
    """`datasets.load_dataset(name, config)` with the offline failure turned into advice."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise DataError("the `datasets` package is needed to load Hub datasets: pip install datasets") from e
    try:
        return datasets.load_dataset(name, config)
    except Exception as e:  # noqa: BLE001 - datasets raises many types for "cannot reach or find"
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        why = "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)" if offline else f"{type(e).__name__}: {e}"
        raise DataError(
            f"could not load the Hub dataset '{name}'{f' ({config})' if config else ''}: {why}. "
            "To work offline, point `data.dataset` at a local directory holding train/test files "
            "(.jsonl, .jsonl.gz, .csv or .parquet with 'text' and 'label' fields), e.g. ../shared/data/imdb."
        ) from None
