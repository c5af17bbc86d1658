"""Write the parity tasks' data (`tasks/*.jsonl`), deterministically, from the lists below.

The files are committed; this script is how they were made, and rerunning it rewrites them
byte for byte. Questions a 135M instruct model gets right often enough for its accuracy to mean
something: one-digit sums, capitals, opposites, categories, the number after another.

    python tools/lm_eval_parity/make_tasks.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS = Path(__file__).parent / "tasks"

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "China": "Beijing",
    "Russia": "Moscow",
    "the United Kingdom": "London",
    "Egypt": "Cairo",
    "Greece": "Athens",
    "Canada": "Ottawa",
    "Australia": "Canberra",
    "Portugal": "Lisbon",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Denmark": "Copenhagen",
    "Poland": "Warsaw",
    "the Netherlands": "Amsterdam",
    "Belgium": "Brussels",
    "Hungary": "Budapest",
    "Turkey": "Ankara",
    "South Korea": "Seoul",
    "Thailand": "Bangkok",
    "Argentina": "Buenos Aires",
    "Peru": "Lima",
    "Kenya": "Nairobi",
    "Cuba": "Havana",
}

OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "fast": "slow",
    "happy": "sad",
    "day": "night",
    "old": "young",
    "open": "closed",
    "wet": "dry",
    "tall": "short",
    "hard": "soft",
    "rich": "poor",
    "early": "late",
    "full": "empty",
    "strong": "weak",
    "good": "bad",
    "left": "right",
    "first": "last",
    "loud": "quiet",
    "clean": "dirty",
    "thick": "thin",
    "win": "lose",
    "push": "pull",
    "buy": "sell",
    "true": "false",
    "black": "white",
    "love": "hate",
    "inside": "outside",
    "above": "below",
    "yes": "no",
}

CATEGORIES = {
    "an animal": ["dog", "cat", "horse", "cow", "lion", "tiger", "rabbit", "sheep", "elephant"],
    "a fruit": ["apple", "banana", "orange", "grape", "pear", "cherry", "lemon", "peach"],
    "a color": ["red", "blue", "green", "yellow", "purple", "pink", "brown"],
    "a vehicle": ["car", "bus", "train", "bicycle", "boat", "truck", "plane"],
    "a body part": ["hand", "foot", "nose", "ear", "knee", "elbow", "finger"],
}

# Few-shot examples of the generation task: one of each kind, none of them in the test split.
GEN_TRAIN = [
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": "What is the capital of Chile?", "answer": "Santiago"},
    {"question": "What is the opposite of near?", "answer": "far"},
    {"question": "What number comes after 9?", "answer": "10"},
]


def multiple_choice(rng: random.Random) -> list[dict]:
    """100 questions of four choices: 25 sums, 25 capitals, 25 opposites, 25 categories."""
    docs = []
    sums = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    for a, b in rng.sample(sums, 25):
        right = a + b
        wrong = rng.sample([n for n in range(max(2, right - 4), right + 5) if n != right], 3)
        docs.append(_choices(rng, f"What is {a} + {b}?", str(right), [str(n) for n in wrong]))
    for country in rng.sample(sorted(CAPITALS), 25):
        others = [c for k, c in sorted(CAPITALS.items()) if k != country]
        question = f"What is the capital of {country}?"
        docs.append(_choices(rng, question, CAPITALS[country], rng.sample(others, 3)))
    for word in rng.sample(sorted(OPPOSITES), 25):
        others = [w for k, w in sorted(OPPOSITES.items()) if k != word and w != OPPOSITES[word]]
        question = f"What is the opposite of {word}?"
        docs.append(_choices(rng, question, OPPOSITES[word], rng.sample(others, 3)))
    kinds = sorted(CATEGORIES)
    for i in range(25):
        kind = kinds[i % len(kinds)]
        right = rng.choice(CATEGORIES[kind])
        wrong = [rng.choice(CATEGORIES[k]) for k in rng.sample([k for k in kinds if k != kind], 3)]
        docs.append(_choices(rng, f"Which of these is {kind}?", right, wrong))
    return docs


def _choices(rng: random.Random, question: str, right: str, wrong: list[str]) -> dict:
    choices = [right, *wrong]
    rng.shuffle(choices)
    return {"question": question, "choices": choices, "answer": choices.index(right)}


def generation(rng: random.Random) -> list[dict]:
    """100 short-answer questions: 25 sums, 25 capitals, 25 opposites, 25 successors."""
    seen = {doc["question"] for doc in GEN_TRAIN}
    sums = [(a, b) for a in range(1, 20) for b in range(1, 20)]
    docs = [
        {"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in rng.sample(sums, 25)
    ]
    for country in rng.sample(sorted(CAPITALS), 25):
        docs.append({"question": f"What is the capital of {country}?", "answer": CAPITALS[country]})
    for word in rng.sample(sorted(OPPOSITES), 25):
        docs.append({"question": f"What is the opposite of {word}?", "answer": OPPOSITES[word]})
    for n in rng.sample(range(11, 100), 25):
        docs.append({"question": f"What number comes after {n}?", "answer": str(n + 1)})
    assert not seen & {doc["question"] for doc in docs}
    return docs


def write_jsonl(path: Path, docs: list[dict]) -> None:
    path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    print(f"wrote {len(docs)} docs to {path}")


def main() -> None:
    write_jsonl(TASKS / "parity_mc.jsonl", multiple_choice(random.Random(41)))
    write_jsonl(TASKS / "parity_gen_test.jsonl", generation(random.Random(42)))
    write_jsonl(TASKS / "parity_gen_train.jsonl", GEN_TRAIN)


if __name__ == "__main__":
    main()
