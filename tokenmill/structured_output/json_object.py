"""What ``json_object`` (``response_format: {"type": "json_object"}``) compiles to on every backend: any
JSON object, within bounds that let a model that was never asked for JSON finish.

Forced into JSON, a small model often repeats itself structurally: the same key nested again and
again (``{"cat":{"cat":{"cat":...``) or the same member over and over (``"Hamlet":1.1,"Hamlet":1.2,...``).
The unbounded grammar allows both forever, so the output ran to ``max_tokens`` and was cut mid-object
(finish_reason "length", invalid JSON). Rejecting a repeated key would stop the second kind exactly,
but "no key twice" is not context-free: no grammar can say it. The bounds below can be said, as a JSON
schema both libraries compile: past them the grammar allows only the way out (a scalar value, ``}``),
so these loops end in valid JSON with finish_reason "stop". Whitespace needs no bound: the backends'
JSON is compact (no free whitespace at all).

What they do not bound: the length of one literal (a key, a string value, a number; a run inside one
still ends only at ``max_tokens``, as free text would) and the number of array items. Bounding keys'
length was tried and left out: both libraries then refuse some escapes in keys, each different ones.
Pure data; never imports torch.
"""
from __future__ import annotations

import json
from functools import lru_cache

# Objects and arrays nested in each other, the outermost object counted: a value 8 levels deep is a scalar.
JSON_OBJECT_MAX_DEPTH = 8
# Members of one object.
JSON_OBJECT_MAX_PROPERTIES = 64

_SCALARS = [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]


def _object(values: dict) -> dict:
    """An object with up to JSON_OBJECT_MAX_PROPERTIES members, each value valid against ``values``."""
    return {"type": "object", "additionalProperties": values, "maxProperties": JSON_OBJECT_MAX_PROPERTIES}


@lru_cache(maxsize=1)
def json_object_schema() -> str:
    """The JSON schema (as text) of a ``json_object`` output: an object within the bounds above.

    ``$defs.level_k`` is any value nested at most ``k`` more levels (``level_0``: a scalar), so the
    schema has no recursion and its size grows linearly with the depth.
    """
    defs = {"level_0": {"anyOf": _SCALARS}}
    for k in range(1, JSON_OBJECT_MAX_DEPTH):
        inner = {"$ref": f"#/$defs/level_{k - 1}"}
        defs[f"level_{k}"] = {"anyOf": [*_SCALARS, {"type": "array", "items": inner}, _object(inner)]}
    schema = _object({"$ref": f"#/$defs/level_{JSON_OBJECT_MAX_DEPTH - 1}"})
    schema["$defs"] = defs
    return json.dumps(schema, sort_keys=True)
