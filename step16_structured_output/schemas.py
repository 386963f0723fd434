"""The formats this step's tests, benchmark and lesson hold output to: one of each kind of constraint a schema
states (required fields, an enum, an array with bounds, a nested object, numbers with bounds, a string pattern)."""

from __future__ import annotations

SCHEMAS = {
    "required": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                         "age": {"type": "integer", "minimum": 0, "maximum": 130}},
                        "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]}}, "required": ["mood"],
             "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                        "minItems": 1, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False},
    # A number's digits are bounded only by a step (multipleOf): without one, 0.1111... is valid for ever.
    "nested": {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25},
                                         "y": {"type": "number", "minimum": -10, "maximum": 10, "multipleOf": 0.25}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
}
