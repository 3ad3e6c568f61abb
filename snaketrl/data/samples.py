"""Small sample datasets in the schemas of the seeds' Hub datasets.

Each generator is deterministic (fixed seed) and carries a signal a tiny model can
learn in a few dozen steps, so the curves in the report move: completions follow
templates that depend on the prompt, chosen answers follow a style the rejected
ones never use.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Alex", "Sam", "Jordan", "Taylor", "Morgan", "Casey", "Riley", "Jamie", "Robin", "Avery"]
RELATIONS = ["roommate", "sister", "brother", "boss", "neighbour", "friend", "cousin", "partner"]
OBJECTS = ["car", "laptop", "bike", "phone", "guitar", "couch", "camera", "jacket", "plant", "lamp"]
VERBS = ["broke", "borrowed", "sold", "lost", "painted", "hid", "returned", "fixed"]
FEELINGS = ["angry", "confused", "happy", "sad", "worried", "relieved", "annoyed", "grateful"]
SUBREDDITS = ["relationships", "AskReddit", "tifu", "personalfinance", "legaladvice"]
FILLER = [
    "It happened on a rainy Tuesday.",
    "We have lived together for two years.",
    "I did not say anything at first.",
    "Everyone at work heard about it.",
    "I tried to talk about it calmly.",
    "This is not the first time something like this happened.",
]

TOPICS = {
    "the moon": "it orbits the Earth about once a month",
    "water": "it boils at one hundred degrees Celsius at sea level",
    "bees": "they make honey from the nectar of flowers",
    "the sun": "it is a star at the centre of our solar system",
    "trains": "they run on rails and carry people and goods",
    "coffee": "it is brewed from roasted coffee beans",
    "penguins": "they are birds that swim but cannot fly",
    "volcanoes": "they erupt when molten rock reaches the surface",
    "bread": "it is baked from flour, water and yeast",
    "rain": "it falls when water droplets in clouds grow heavy",
}
QUESTION_FORMS = ["Tell me about {t}.", "What do you know about {t}?", "Can you explain {t}?", "Give me a fact about {t}."]
REJECTED_FORMS = ["I don't know.", "No.", "Why would I tell you about {t}?", "Ask someone else.", "Whatever."]

ADJECTIVES = ["ancient", "shimmering", "crimson", "quiet", "enormous", "delicate", "golden", "misty", "weathered", "velvet"]
NOUNS = ["door", "lantern", "garden", "river", "tower", "letter", "forest", "mirror", "bridge", "window"]
OPENINGS = ["She walked into the room and saw", "At the end of the road he found", "Through the window they noticed",
            "When the storm ended we discovered", "Behind the house there was"]

ZH_COLORS = {"红色": "red", "蓝色": "blue", "绿色": "green", "黑色": "black", "白色": "white"}
ZH_ANIMALS = {"猫": "cat", "狗": "dog", "鸟": "bird", "鱼": "fish", "马": "horse"}
ZH_WORDS = ["你好", "谢谢", "春天", "月亮", "大海", "朋友"]


def tldr(n: int, rng: random.Random) -> list[dict]:
    """trl-lib/tldr: prompt/completion strings; the summary restates the post's key facts. Two in
    three summaries leave out how the poster feels: a reward for complete summaries (`keyword`
    "feel") has room to climb from a policy that imitates them (GRPO's default)."""
    rows = []
    for _ in range(n):
        name, rel, obj, verb, feel = (rng.choice(x) for x in (NAMES, RELATIONS, OBJECTS, VERBS, FEELINGS))
        filler = " ".join(rng.sample(FILLER, k=rng.randint(1, 4)))
        post = f"My {rel} {name} {verb} my {obj}. {filler} Now I feel {feel} and I do not know what to do."
        title = f"My {rel} {verb} my {obj}, what now?"
        summary = f" {name} {verb} my {obj} and I feel {feel}." if rng.random() < 1 / 3 else f" {name} {verb} my {obj}."
        rows.append({
            "prompt": f"SUBREDDIT: r/{rng.choice(SUBREDDITS)}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:",
            "completion": summary,
        })
    return rows


def ultrafeedback(n: int, rng: random.Random) -> list[dict]:
    """trl-lib/ultrafeedback_binarized: conversational chosen/rejected, the prompt implicit in both."""
    rows = []
    for _ in range(n):
        topic = rng.choice(list(TOPICS))
        question = rng.choice(QUESTION_FORMS).format(t=topic)
        good = f"Sure! Here is a fact about {topic}: {TOPICS[topic]}. Hope this helps!"
        bad = rng.choice(REJECTED_FORMS).format(t=topic)
        user = {"content": question, "role": "user"}
        rows.append({
            "chosen": [user, {"content": good, "role": "assistant"}],
            "rejected": [user, {"content": bad, "role": "assistant"}],
            "score_chosen": float(rng.randint(7, 10)),
            "score_rejected": float(rng.randint(1, 4)),
        })
    return rows


def descriptiveness(n: int, rng: random.Random) -> list[dict]:
    """trl-internal-testing/descriptiveness-sentiment-trl-style: prompt/chosen/rejected strings."""
    rows = []
    for _ in range(n):
        noun = rng.choice(NOUNS)
        adjs = rng.sample(ADJECTIVES, k=3)
        rows.append({
            "prompt": f"{rng.choice(OPENINGS)} a",
            "chosen": f" {adjs[0]}, {adjs[1]} {noun} beside a {adjs[2]} {rng.choice(NOUNS)}.",
            "rejected": f" {noun}.",
        })
    return rows


def firefly(n: int, rng: random.Random) -> list[dict]:
    """YeungNLP/firefly-train-1.1M: kind/input/target (Chinese instructions)."""
    rows = []
    for _ in range(n):
        if rng.random() < 0.5:
            color, animal = rng.choice(list(ZH_COLORS)), rng.choice(list(ZH_ANIMALS))
            rows.append({"kind": "Translation", "input": f"翻译成英文:{color}的{animal}",
                         "target": f"{ZH_COLORS[color]} {ZH_ANIMALS[animal]}"})
        else:
            word = rng.choice(ZH_WORDS)
            rows.append({"kind": "Repeat", "input": f"把这个词重复三次:{word}", "target": word * 3})
    return rows


ITEMS = ["apples", "books", "stickers", "marbles", "cookies", "pencils"]


def sum_row(name: str, item: str, a: int, b: int) -> dict:
    return {
        "question": f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        "answer": f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n#### {a + b}",
    }


OPERANDS = range(2, 41)    # the arithmetic sample's operands, and its derived prompt sets


def arithmetic(n: int, rng: random.Random) -> list[dict]:
    """openai/gsm8k: question/answer, the final number after `####` (verifiable rewards)."""
    rows = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(OPERANDS.start, OPERANDS.stop - 1), rng.randint(OPERANDS.start, OPERANDS.stop - 1)
        rows.append(sum_row(name, item, a, b))
    return rows


def sum_operands(rows: list[dict]) -> set[frozenset]:
    """The unordered operand pairs {a, b} of arithmetic rows."""
    return {frozenset(map(int, row["answer"].split("<<")[1].split("=")[0].split("+"))) for row in rows}


def carries(a: int, b: int) -> bool:
    """Whether the units of a + b carry into the tens."""
    return a % 10 + b % 10 >= 10


def unseen_sums(n: int, rng: random.Random, taken: set[frozenset], carry: bool, sample: str) -> list[tuple[int, int]]:
    """n distinct ordered operand pairs of the arithmetic range whose units carry (`carry`) or do not, none of them
    one of `taken` in either order. `sample` names the prompt set in the error."""
    pairs = [(a, b) for a in OPERANDS for b in OPERANDS if carries(a, b) == carry and frozenset((a, b)) not in taken]
    if n > len(pairs):
        kind = "carrying" if carry else "non-carrying"
        raise ValueError(f"{sample}: {n} {kind} rows asked for, {len(pairs)} {kind} sums not in the arithmetic sample")
    return rng.sample(pairs, n)


def arithmetic_carry(n: int, rng: random.Random, taken: set[frozenset]) -> list[dict]:
    """The arithmetic task (same operand range, same form) on sums whose units carry: the sums a model trained on
    the arithmetic sample most often gets wrong, so a group of its sampled answers has reward spread (GRPO's
    signal). No pair of operands is one of `taken` (the arithmetic sample's, held-out rows included), in either
    order, so its held-out questions stay unseen."""
    return [sum_row(rng.choice(NAMES), rng.choice(ITEMS), a, b)
            for a, b in unseen_sums(n, rng, taken, True, "arithmetic_carry")]


def arithmetic_mixed(n: int, rng: random.Random, taken: set[frozenset]) -> list[dict]:
    """As `arithmetic_carry`, but half the sums carry and half do not, in random order: trained on carrying sums
    alone, GRPO learned to carry everywhere (docs/real-model.md, the fourth try); beside sums that do not carry, a
    carry added where none belongs scores below its group's right answers."""
    pairs = (unseen_sums(n // 2, rng, taken, True, "arithmetic_mixed")
             + unseen_sums(n - n // 2, rng, taken, False, "arithmetic_mixed"))
    rng.shuffle(pairs)
    return [sum_row(rng.choice(NAMES), rng.choice(ITEMS), a, b) for a, b in pairs]


GENERATORS = {"tldr": tldr, "ultrafeedback": ultrafeedback, "descriptiveness": descriptiveness, "firefly": firefly,
              "arithmetic": arithmetic}


def write_samples(out_dir: str | Path, n: int = 400, seed: int = 0) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    written = {}
    for name, gen in GENERATORS.items():
        written[name] = gen(n, random.Random(f"{seed}-{name}"))
    for name, derive in (("arithmetic_carry", arithmetic_carry), ("arithmetic_mixed", arithmetic_mixed)):
        written[name] = derive(n, random.Random(f"{seed}-{name}"), sum_operands(written["arithmetic"]))
    for name, rows in written.items():
        path = out_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        paths.append(path)
    return paths
