"""JSON Schema (draft 2020-12) of the ``genoctx eval --by-position --format json`` document.

Human description: ``docs/eval_schema.md`` (every property named here is described there; a test checks it).
Fields are only ever added to this schema, never removed or renamed; ``format_version`` of the prepared data
is unrelated.
"""

from __future__ import annotations

_NUM = {"type": ["number", "null"]}
_CI = {"type": ["array", "null"], "items": {"type": "number"}, "minItems": 2, "maxItems": 2}

_STATS = {
    "tokens": {"type": "integer", "minimum": 0},
    "loss": _NUM,
    "bits_per_base": _NUM,
    "loss_ci": _CI,
    "bits_per_base_ci": _CI,
    "baseline_loss": _NUM,
    "difference": _NUM,
    "difference_ci": _CI,
    "relative_change": _NUM,
    "relative_change_ci": _CI,
    "markov_loss": _NUM,
    "markov_relative_change": _NUM,
    "markov_relative_change_ci": _CI,
    "reference_loss": _NUM,
    "reference_relative_change": _NUM,
    "reference_relative_change_ci": _CI,
}

BIN = {
    "type": "object",
    "required": ["start", "end", "tokens", "loss", "bits_per_base"],
    "properties": {"start": {"type": "integer", "minimum": 0}, "end": {"type": "integer"}, **_STATS},
}
OVERALL = {"type": "object", "required": ["tokens", "loss", "bits_per_base"], "properties": _STATS}
BLOCK = {
    "type": "object",
    "required": ["bins", "overall"],
    "properties": {"bins": {"type": "array", "items": BIN}, "overall": OVERALL},
}
COPY_ROW = {
    "type": "object",
    "required": ["distance", "tokens", "copied_loss", "in_place_loss", "gain"],
    "properties": {
        "distance": {"type": "integer", "minimum": 1},
        "tokens": {"type": "integer", "minimum": 0},
        "copied_loss": _NUM,
        "copied_ci": _CI,
        "in_place_loss": _NUM,
        "in_place_ci": _CI,
        "gain": _NUM,
        "gain_ci": _CI,
    },
}
COPY_PROBE = {
    "type": "object",
    "required": ["segment", "rows", "reach"],
    "properties": {
        "segment": {"type": "integer", "minimum": 1},
        "rows": {"type": "array", "items": COPY_ROW},
        "reach": {"type": ["integer", "null"]},
    },
}
VIEW_NAME = "^(forward|reverse|both)/(all|softmasked|unmasked)$"
VIEWS = {"type": "object", "propertyNames": {"pattern": VIEW_NAME}, "additionalProperties": BLOCK}
MODEL = {
    "type": "object",
    "required": ["name", "kind", "path", "baseline", "reported", "bins", "overall"],
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["checkpoint", "markov", "reference", "model"]},
        "path": {"type": ["string", "null"]},
        "order": {"type": "integer", "minimum": 0},
        "alpha": {"type": "number", "minimum": 0},
        "train_tokens": {"type": "integer", "minimum": 0},
        "kmer": {"type": "integer", "minimum": 1},
        "experts": {"type": "integer", "minimum": 1},
        "loss_vocab": {"enum": ["full", "nucleotide", None]},
        "baseline": {"type": "boolean"},
        "reported": {"type": "boolean"},
        "bins": {"type": "array", "items": BIN},
        "overall": OVERALL,
        "views": VIEWS,
        "copy_probe": COPY_PROBE,
        "last_vs_first_bin": {
            "type": ["object", "null"],
            "required": ["first_bin", "last_bin", "first_change", "last_change", "change_difference"],
            "properties": {
                "first_bin": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
                "last_bin": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
                "first_change": {"type": "number"},
                "last_change": {"type": "number"},
                "change_difference": {"type": "number"},
                "change_difference_ci": _CI,
            },
        },
    },
}

SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "genoctx eval --by-position",
    "type": "object",
    "required": ["bins", "overall", "checkpoint", "baseline", "split", "windows", "window"],
    "properties": {
        "bins": {"type": "array", "minItems": 1, "items": BIN},
        "overall": OVERALL,
        "checkpoint": {"type": ["string", "null"]},
        "baseline": {"type": ["string", "null"]},
        "reported": {"type": "string"},
        "split": {"type": "string"},
        "windows": {"type": "integer", "minimum": 1},
        "window": {"type": "integer", "minimum": 1},
        "edges": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
        "confidence": {
            "type": "object",
            "required": ["level", "method", "resamples", "seed"],
            "properties": {
                "level": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                "method": {"type": "string"},
                "resamples": {"type": "integer", "minimum": 0},
                "seed": {"type": "integer"},
            },
        },
        "models": {"type": "array", "minItems": 1, "items": MODEL},
        "views": VIEWS,
        "copy_probe": {
            "type": "object",
            "required": ["segment", "distances", "reach_gain"],
            "properties": {
                "segment": {"type": "integer", "minimum": 1},
                "distances": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                "reach_gain": {"type": "number"},
            },
        },
    },
}


def property_names(schema: dict | None = None) -> set[str]:
    """Every property name used anywhere in ``schema`` (default :data:`SCHEMA`)."""
    out: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.get("properties", {}).items():
                out.add(k)
                walk(v)
            for k in ("items", "additionalProperties"):
                if isinstance(node.get(k), dict):
                    walk(node[k])

    walk(schema or SCHEMA)
    return out
