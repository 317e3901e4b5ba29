"""Regenerate the bundled instruction dataset: ``python -m mnft.recipes.assets.generate``.

Three string tasks a tiny model can visibly learn within a few dozen steps: uppercase a phrase, reverse
the order of its words, list its first letters. Fully deterministic (fixed seed), so the file is stable.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "red blue green fox dog cat bird fish tree rock sun moon star rain snow wind fire lake hill road "
    "cold warm fast slow big small old new dark light soft hard loud quiet sweet bitter happy brave "
    "apple bread milk stone river cloud grass sand wave leaf"
).split()

TASKS = {
    "Uppercase": lambda ws: " ".join(w.upper() for w in ws),
    "Reverse the words": lambda ws: " ".join(reversed(ws)),
    "First letters": lambda ws: " ".join(w[0] for w in ws),
}


def examples(n: int = 2000, seed: int = 1234) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        task = rng.choice(sorted(TASKS))
        ws = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
        out.append({"instruction": f"{task}: {' '.join(ws)}", "response": TASKS[task](ws)})
    return out


def main() -> None:
    path = Path(__file__).with_name("instruct.jsonl")
    with path.open("w") as f:
        for ex in examples():
            f.write(json.dumps(ex) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
