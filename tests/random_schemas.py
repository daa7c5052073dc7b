"""Seeded random JSON schemas for the structured-output tests: nested objects, arrays, enums,
bounded integers and numbers, strings, booleans, required fields; small enough that a short
completion fills them."""

from __future__ import annotations

import random

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "cat", "dog", "north", "south", "yes", "no"]
NAMES = ["id", "name", "count", "price", "tags", "active", "color", "size", "owner", "items", "score", "kind"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema for one value; objects and arrays nest at most two levels below the root object."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 10)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 20)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(NAMES, rng.randint(1, 3 if depth else 4))
    properties = {name: random_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def random_schemas(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_object(rng) for _ in range(count)]
