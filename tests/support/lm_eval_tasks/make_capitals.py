"""Writes capitals.jsonl, the data of the lm-eval tasks in this directory (capitals_mc,
capitals_gen), from the table below: one item per country, its question, its capital, and
for the multiple choice three other capitals of the table as distractors, drawn with a fixed
seed (the answer's place among the four choices drawn too).

    .venv/bin/python tests/support/lm_eval_tasks/make_capitals.py   # rewrites capitals.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Well-known capitals (facts, not written prose), so that a 135M model gets most of them.
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "the United Kingdom": "London",
    "Egypt": "Cairo", "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna",
    "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Denmark": "Copenhagen", "Poland": "Warsaw", "Hungary": "Budapest", "the Czech Republic": "Prague",
    "Thailand": "Bangkok", "South Korea": "Seoul", "Argentina": "Buenos Aires", "Peru": "Lima",
    "Kenya": "Nairobi", "Cuba": "Havana", "India": "New Delhi", "Canada": "Ottawa",
}
SEED = 1234
OUT = Path(__file__).with_name("capitals.jsonl")


def items(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    capitals = list(CAPITALS.values())
    rows = []
    for country, capital in CAPITALS.items():
        choices = rng.sample([c for c in capitals if c != capital], 3)
        label = rng.randrange(4)
        choices.insert(label, capital)
        rows.append({"country": country, "question": f"What is the capital of {country}?",
                     "answer": capital, "choices": choices, "label": label})
    return rows


def main() -> None:
    OUT.write_text("".join(json.dumps(row) + "\n" for row in items()))
    print(f"wrote {OUT} ({len(CAPITALS)} items)")


if __name__ == "__main__":
    main()
