"""Write the bundled prompt sets, `specserve/data/train_prompts.jsonl` and
`specserve/data/heldout_prompts.jsonl`, from the templates and topics of
`prompt_vocabulary.py`:

    python tools/make_prompts.py          # rewrite both files
    python tools/make_prompts.py --check  # only compare them with what would be written

- train: `build_train_prompts()`, 12,000 prompts: explanations, lists, code, maths,
  summarising, rewriting, creative writing, e-mails, advice/chat, comparisons.
- heldout: `build_heldout_prompts()`, 100 prompts from other templates and other topics, never
  trained on; `specserve bench acceptance` measures on them.

Both are deterministic functions of their seed, so the files are reproduced byte for byte.
Each line is {"prompt": str, "category": str}. The package only reads them
(`specserve.train.prompts.load_prompts`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import prompt_vocabulary as words

DATA = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specserve", "data"
)


def _fill(template: str, rng: random.Random, slots: dict[str, list[str]]) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    small = rng.randint(2, 12)
    values = {
        "a": a,
        "b": b,
        "c": a + b + rng.randint(1, 50),
        "small": small,
        "big": rng.choice([20, 40, 60, 75, 80, 120, 150, 200, 240, 300, 360, 500, 1000]),
        "pct": rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]),
        "speed": rng.choice([40, 60, 80, 90, 120, 150]),
        "square": rng.randint(2, 30) ** 2,
        "n": rng.choice([3, 4, 5, 5, 7, 10]),
        "name": rng.choice(words.NAMES),
        "item": rng.choice(words.ITEMS),
    }
    pair = rng.choice(words.PAIRS)
    values["x"], values["y"] = pair
    for key, options in slots.items():
        values[key] = rng.choice(options)
    return template.format(**values)


def _train_slots() -> dict[str, list[str]]:
    return {
        "topic": words.TOPICS,
        "activity": words.ACTIVITIES,
        "goal": words.GOALS,
        "things": words.THINGS,
        "code_task": words.CODE_TASKS,
        "lang": words.LANGS,
        "code_concept": words.CODE_CONCEPTS,
        "snippet": words.SNIPPETS,
        "math_concept": words.MATH_CONCEPTS,
        "paragraph": words.PARAGRAPHS,
        "sentence": words.SENTENCES,
        "character": words.CHARACTERS,
        "event": words.EVENTS,
        "place": words.PLACES,
        "product": words.PRODUCTS,
        "business": words.BUSINESSES,
        "recipient": words.RECIPIENTS,
        "purpose": words.PURPOSES,
        "emotion": words.EMOTIONS,
        "situation": words.SITUATIONS,
        "recommendation": words.RECOMMENDATIONS,
        "problem": words.PROBLEMS,
        "chat": words.CHAT,
    }


def _build(templates, weights, slots, styles, n: int, seed: int, exclude=frozenset()):
    rng = random.Random(seed)
    cats = list(templates)
    w = [weights.get(c, 1) for c in cats]
    seen, out = set(exclude), []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n:
            raise RuntimeError(f"only {len(out)} distinct prompts; add templates or topics")
        cat = rng.choices(cats, w)[0]
        text = _fill(rng.choice(templates[cat]), rng, slots)
        style = rng.choice(styles)
        if style and cat not in ("summarize", "rewrite", "email"):
            text += style
        if text in seen:
            continue
        seen.add(text)
        out.append({"prompt": text, "category": cat})
    return out


def build_train_prompts(n: int = 12000, seed: int = 0) -> list[dict]:
    return _build(
        words.TRAIN_TEMPLATES, words.CATEGORY_WEIGHTS, _train_slots(), words.STYLES, n, seed
    )


def build_heldout_prompts(n: int = 100, seed: int = 1) -> list[dict]:
    slots = dict(words.HELDOUT_SLOTS, topic=words.HELDOUT_TOPICS)
    styles = ["", "", " Keep the answer brief.", " Explain your reasoning."]
    return _build(words.HELDOUT_TEMPLATES, {}, slots, styles, n, seed)


def to_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write the bundled train and held-out prompt sets")
    p.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    p.add_argument("--data-dir", default=DATA, help=f"where the files go (default {DATA})")
    args = p.parse_args(argv)
    train = build_train_prompts()
    heldout = build_heldout_prompts()
    overlap = {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert not overlap, overlap
    differ = []
    for name, rows in (("train", train), ("heldout", heldout)):
        path = os.path.join(args.data_dir, f"{name}_prompts.jsonl")
        text = to_jsonl(rows)
        if args.check:
            with open(path, encoding="utf-8") as f:
                if f.read() != text:
                    differ.append(path)
            continue
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if args.check:
        print(f"differ: {differ}" if differ else f"{len(train)} + {len(heldout)} prompts: same")
        return 1 if differ else 0
    print(f"wrote {len(train)} training and {len(heldout)} held-out prompts to {args.data_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
