"""Metrics of the capitals_gen lm-eval task (loaded by lm-eval through ``!function``)."""

from __future__ import annotations

import re
import string


def normalize(text: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed."""
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(text.split())


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """contains: the capital appears in the answer as whole words ("The capital of France is
    Paris." counts, "Parisian" does not); exact_match: the answer is the capital and nothing else."""
    answer, gold = normalize(results[0]), normalize(doc["answer"])
    return {
        "contains": float(re.search(rf"\b{re.escape(gold)}\b", answer) is not None),
        "exact_match": float(answer == gold),
    }
