"""Write the quickstart's sample corpus: short movie reviews labelled negative (0) / positive (1).

The reviews are composed from hand-written phrase lists with a fixed seed, so the files are
reproducible: `python -m bertaccel.data.samples.make_sentiment` rewrites them byte for byte. About one
review in six carries a negation or a contrast ("not great", "..., but the ending is awful") whose
label follows the last clause, so the task is not solvable from a single word list.
The vocabulary (`vocab.txt`) is WordPiece: BERT's special tokens, every word of the corpus, and
single characters with `##` continuations, so any text tokenizes without `[UNK]` floods.
"""

import json
import random
import string
from pathlib import Path

OUT = Path(__file__).parent / "sentiment"

SUBJECTS = [
    "the movie", "this film", "the acting", "the plot", "the script", "the soundtrack",
    "the director's work", "the cast", "the story", "the ending", "the dialogue", "the pacing",
    "the cinematography", "the lead actor", "the lead actress", "the sequel", "the special effects",
]
POSITIVE = [
    "wonderful", "brilliant", "moving", "delightful", "superb", "gripping", "charming",
    "excellent", "beautiful", "clever", "funny", "memorable", "touching", "stunning", "great",
]
NEGATIVE = [
    "boring", "awful", "dull", "terrible", "clumsy", "predictable", "tedious", "weak",
    "painful", "forgettable", "bland", "messy", "annoying", "lifeless", "bad",
]
INTENSIFIERS = ["", "", "really ", "truly ", "quite ", "absolutely ", "rather ", "so "]
OPENERS = [
    "", "", "honestly, ", "i think ", "in my opinion ", "overall ", "to be fair, ",
    "after two hours, ", "my friends agreed: ", "as a longtime fan, ",
]
CLOSERS = [
    "", "", "", " i would watch it again.", " i left early.", " ten out of ten.",
    " what a night.", " see it in a theater.", " skip it.", " bring popcorn.",
]
NEUTRAL = [
    "it runs about two hours.", "it was released last spring.", "i saw it on a tuesday.",
    "the theater was half full.", "it is based on a novel.", "it was filmed in canada.",
]


def clause(rng: random.Random, positive: bool) -> str:
    words = POSITIVE if positive else NEGATIVE
    return f"{rng.choice(SUBJECTS)} is {rng.choice(INTENSIFIERS)}{rng.choice(words)}"


def review(rng: random.Random, label: int) -> str:
    positive = bool(label)
    kind = rng.random()
    if kind < 0.08:  # negation flips the adjective's polarity
        adjectives = NEGATIVE if positive else POSITIVE
        body = f"{rng.choice(SUBJECTS)} is not {rng.choice(adjectives)} at all"
    elif kind < 0.17:  # contrast: the last clause decides
        body = f"{clause(rng, not positive)}, but {clause(rng, positive)}"
    else:
        body = clause(rng, positive)
        if rng.random() < 0.4:
            body += f" and {clause(rng, positive)}"
    text = f"{rng.choice(OPENERS)}{body}."
    if rng.random() < 0.3:
        text = f"{rng.choice(NEUTRAL)} {text}"
    return (text + rng.choice(CLOSERS)).strip()


def build_vocab(texts: list[str]) -> list[str]:
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    words = set()
    for t in texts:
        for w in t.replace(",", " , ").replace(".", " . ").replace(":", " : ").replace("'", " ' ").split():
            words.add(w)
    words -= set(chars)
    return special + chars + ["##" + c for c in chars] + sorted(words)


def main() -> None:
    rng = random.Random(20261122)
    OUT.mkdir(parents=True, exist_ok=True)
    splits = {"train": 1200, "test": 400}
    all_texts = []
    for split, n in splits.items():
        rows = [{"text": review(rng, label), "label": label} for label in (0, 1) for _ in range(n // 2)]
        rng.shuffle(rows)
        all_texts += [r["text"] for r in rows]
        with open(OUT / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    (OUT / "vocab.txt").write_text("\n".join(build_vocab(all_texts)) + "\n", encoding="utf-8")
    (OUT / "classes.txt").write_text("negative\npositive\n", encoding="utf-8")


if __name__ == "__main__":
    main()
