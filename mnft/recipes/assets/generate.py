"""Regenerate the bundled instruction dataset: ``python -m mnft.recipes.assets.generate``.

Three sequence tasks a tiny model visibly learns within a few dozen steps: count up or down between two
numbers, list the letters between two letters. Once the first item is right every next one follows from the
previous, so the loss on responses falls fast; starting and stopping at the right place needs the prompt.
Fully deterministic (fixed seed), so the file is stable.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path


def _one(rng: random.Random) -> dict[str, str]:
    task = rng.choice(["up", "down", "letters"])
    if task == "letters":
        a = rng.randrange(0, 20)
        b = rng.randrange(a + 2, min(a + 9, 26))
        seq = string.ascii_lowercase[a: b + 1]
        return {"instruction": f"List the letters from {seq[0]} to {seq[-1]}", "response": " ".join(seq)}
    a = rng.randrange(0, 40)
    b = rng.randrange(a + 2, a + 10)
    nums = [str(n) for n in range(a, b + 1)]
    if task == "down":
        return {"instruction": f"Count down from {b} to {a}", "response": " ".join(reversed(nums))}
    return {"instruction": f"Count up from {a} to {b}", "response": " ".join(nums)}


def examples(n: int = 2000, seed: int = 1234) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [_one(rng) for _ in range(n)]


def main() -> None:
    path = Path(__file__).with_name("instruct.jsonl")
    with path.open("w") as f:
        for ex in examples():
            f.write(json.dumps(ex) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
