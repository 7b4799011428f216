"""JSON-schema checks done before a backend sees a schema: is it a valid schema at all
(``jsonschema``'s meta-schema check), and, for backends that would otherwise ignore keywords they
do not implement, does it use only keywords the backend enforces. Never imports torch.
"""
from __future__ import annotations

import json
from typing import Any

import jsonschema

from tokenmill.structured_output.backend import ConstraintError

# Keywords that describe and never constrain.
ANNOTATION_KEYWORDS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor", "deprecated",
    "readOnly", "writeOnly",
})

# Keywords xgrammar 0.2 enforces (checked against generated outputs: tests/test_structured_output_backends.py).
# It accepts and silently ignores others (not, oneOf, allOf, if/then/else, uniqueItems,
# dependentRequired...), so those are refused instead.
XGRAMMAR_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "properties", "required",
    "additionalProperties", "patternProperties", "propertyNames", "unevaluatedProperties", "minProperties",
    "maxProperties", "items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "minLength", "maxLength",
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
}) | ANNOTATION_KEYWORDS
# Formats xgrammar 0.2 enforces exactly ("date", "date-time" and "ipv4" are approximations: Feb 30,
# leading zeros).
XGRAMMAR_FORMATS = frozenset({
    "email", "time", "duration", "uuid", "ipv6", "hostname", "uri", "uri-reference", "json-pointer",
})
_STRUCTURE_KEYS = frozenset({"$defs", "definitions"}) | ANNOTATION_KEYWORDS
_PY_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
             "object": (dict,), "array": (list,)}

# Where subschemas sit: keyword -> "one" (a schema), "list" (schemas), "map" (name -> schema).
_SUBSCHEMAS = {
    "items": "one", "additionalProperties": "one", "propertyNames": "one", "unevaluatedProperties": "one",
    "unevaluatedItems": "one", "contains": "one", "not": "one", "if": "one", "then": "one", "else": "one",
    "prefixItems": "list", "anyOf": "list", "oneOf": "list", "allOf": "list",
    "properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map", "dependentSchemas": "map",
}


def load_json_schema(spec: str, kind: str = "json") -> dict:
    """Parse a JSON schema's text and check it against its meta-schema (draft 2020-12 unless its
    ``$schema`` says otherwise).

    Raises:
        ConstraintError: not JSON, not an object, or not a valid JSON schema (naming the place).
    """
    try:
        schema = json.loads(spec)
    except ValueError as exc:
        raise ConstraintError(kind, f"the schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ConstraintError(kind, f"the schema must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ConstraintError(kind, f"not a valid JSON schema at {where}: {exc.message}") from None
    return schema


_LOOK_AROUND = ("(?=", "(?!", "(?<=", "(?<!")


def check_keywords(schema: Any, allowed: frozenset[str], formats: frozenset[str], backend: str, kind: str = "json",
                   path: str = "#") -> None:
    """xgrammar's schema check: refuse a keyword (or string format) outside ``allowed``
    (``formats``) anywhere in the schema; what xgrammar would drop with only a log warning
    (``multipleOf`` on a type other than ``integer``, look-around in a ``pattern``); and keyword
    combinations it compiles without enforcing them together (``_check_xgrammar_combination``).

    Raises:
        ConstraintError: naming the keyword, its place (a JSON pointer) and the backend.
    """
    if not isinstance(schema, dict):
        return  # true / false schemas
    if "multipleOf" in schema and schema.get("type") != "integer":
        raise ConstraintError(kind, f"the {backend} backend enforces 'multipleOf' only on integers (at {path}); "
                                    "use the other backend or type integer")
    if isinstance(schema.get("pattern"), str) and any(look in schema["pattern"] for look in _LOOK_AROUND):
        raise ConstraintError(kind, f"the {backend} backend cannot enforce look-around in 'pattern' (at {path}/pattern)")
    _check_xgrammar_combination(schema, backend, kind, path)
    for key, value in schema.items():
        if key not in allowed:
            raise ConstraintError(kind, f"the {backend} backend cannot enforce the JSON schema keyword "
                                        f"'{key}' (at {path}); use the other backend or drop the keyword")
        if key == "format" and value not in formats:
            raise ConstraintError(kind, f"the {backend} backend cannot enforce the string format {value!r} "
                                        f"(at {path}/format)")
        shape = _SUBSCHEMAS.get(key)
        if shape == "one":
            check_keywords(value, allowed, formats, backend, kind, f"{path}/{key}")
        elif shape == "list" and isinstance(value, list):
            for i, sub in enumerate(value):
                check_keywords(sub, allowed, formats, backend, kind, f"{path}/{key}/{i}")
        elif shape == "map" and isinstance(value, dict):
            for name, sub in value.items():
                check_keywords(sub, allowed, formats, backend, kind, f"{path}/{key}/{name}")


def _check_xgrammar_combination(schema: dict, backend: str, kind: str, path: str) -> None:
    """Refuse keyword combinations xgrammar 0.2 compiles but does not enforce together: string
    lengths beside ``format``/``pattern``; ``enum``/``const`` beside anything but a ``type`` that
    every value has; siblings of ``anyOf``/``$ref``; ``anyOf`` branches with nothing that fixes
    their type; ``required`` naming a property missing from ``properties``.

    Raises:
        ConstraintError: naming the keywords and their place.
    """
    def refuse(what: str) -> ConstraintError:
        return ConstraintError(kind, f"the {backend} backend does not enforce {what} (at {path}); use the "
                                     "other backend or simplify the schema")

    keys = set(schema)
    if keys & {"minLength", "maxLength"} and keys & {"format", "pattern"}:
        raise refuse("minLength/maxLength together with format or pattern")
    for key in ("enum", "const"):
        if key in keys:
            extra = keys - _STRUCTURE_KEYS - {key, "type"}
            if extra:
                raise refuse(f"'{key}' together with {sorted(extra)}")
            values = schema[key] if key == "enum" else [schema[key]]
            types = schema.get("type")
            if types is not None and isinstance(values, list):
                allowed = tuple(t for name in ([types] if isinstance(types, str) else types)
                                for t in _PY_TYPES.get(name, ()))
                wrong = [v for v in values if not isinstance(v, allowed)
                         or (isinstance(v, bool) and bool not in allowed)]
                if wrong:
                    raise refuse(f"'{key}' values outside 'type' ({wrong[:3]})")
    for key in ("anyOf", "$ref"):
        if key in keys:
            extra = keys - _STRUCTURE_KEYS - {key}
            if extra:
                raise refuse(f"keywords beside '{key}' ({sorted(extra)})")
    for i, branch in enumerate(schema.get("anyOf") or []):
        if isinstance(branch, dict) and not set(branch) & {"type", "$ref", "enum", "const", "anyOf"}:
            raise refuse(f"an anyOf branch without type, $ref, enum or const (anyOf/{i})")
    required = schema.get("required")
    if isinstance(required, list):
        missing = [name for name in required if name not in (schema.get("properties") or {})]
        if missing:
            raise refuse(f"'required' naming properties missing from 'properties' ({missing[:3]})")
