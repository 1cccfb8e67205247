"""The structured-output test corpus: JSON schemas, regexes, choice lists and grammars, each
with a checker of its language and a max_tokens that the output provably fits in.

No tests here: the engine's, the server's and the benchmark's tests import it
(tests/support/test_structured_cases.py checks the corpus itself, with llguidance and no engine).

    from tests.support.structured_cases import CASES, max_tokens_for
    for case in CASES:
        params = SamplingParams(max_tokens=max_tokens_for(case),
                                structured_outputs=case.params)
        case.check(output.text)  # AssertionError naming the case if the text is not valid

Every language is finite: strings have a maxLength or an anchored bounded pattern, arrays a
maxItems, numbers a minimum, a maximum and (non-integers) a multipleOf, objects
additionalProperties false, JSON whitespace is off (disable_any_whitespace) or a bounded
whitespace_pattern, and grammar repetitions are {m,n}. A tiny random model wanders through
whatever a grammar allows; here it cannot wander past the end. Each case's max_tokens is one more
(the EOS) than the most UTF-8 bytes an output can have, and every token is at least one byte, so
any tokenizer's output finishes within it.
"""

from __future__ import annotations

import ast
import csv
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from pagedjax.sampling_params import StructuredOutputsParams

try:  # Python >= 3.11
    from re import _parser as _sre_parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parser

MAX_CHAR_BYTES = 6  # the most bytes a JSON string character takes: a "\u0001" escape


@dataclass(frozen=True)
class StructuredCase:
    name: str
    params: StructuredOutputsParams
    check: Callable[[str], None]  # raises AssertionError if text is not in the language
    max_tokens: int  # every output of the language fits, EOS included

    @property
    def kind(self) -> str:
        """"json", "regex", "choice" or "grammar"."""
        return self.params.kind

    def __repr__(self) -> str:  # pytest ids
        return f"StructuredCase({self.name})"


def max_tokens_for(case: StructuredCase) -> int:
    """The max_tokens a request for this case needs: its longest output in bytes, plus EOS."""
    return case.max_tokens


# ---- bounds ----------------------------------------------------------------------------------


def regex_max_chars(pattern: str) -> int:
    """The most characters a match of the (bounded) regex can have."""
    width = _sre_parser.parse(pattern).getwidth()[1]
    if width >= _sre_parser.MAXREPEAT:
        raise ValueError(f"the regex {pattern!r} is unbounded")
    return width


def json_max_bytes(schema: dict) -> int:
    """The most bytes compact JSON text valid for a bounded schema can have (the keywords this
    corpus uses); ValueError for an unbounded one."""
    return _json_bounds(schema, schema)[0]


def _json_bounds(schema: dict, root: dict) -> tuple[int, int]:
    """(most bytes of compact JSON text valid for the schema, most JSON lexemes in it)."""
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"only local $defs references are bounded here: {ref}")
        return _json_bounds(root["$defs"][ref.removeprefix("#/$defs/")], root)
    if "const" in schema:
        return _value_bounds(schema["const"])
    if "enum" in schema:
        return _most(_value_bounds(v) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _most(_json_bounds(branch, root) for branch in schema[key])
    types = schema.get("type")
    if isinstance(types, list):
        return _most(_json_bounds({**schema, "type": t}, root) for t in types)
    if types == "null":
        return 4, 1
    if types == "boolean":
        return 5, 1
    if types == "string":
        chars = [schema[k] for k in ("maxLength",) if k in schema]
        pattern = schema.get("pattern")
        if pattern is not None and pattern.startswith("^") and pattern.endswith("$"):
            try:  # an unanchored pattern matches anything containing a match
                chars.append(regex_max_chars(pattern))
            except ValueError:
                pass
        if not chars:
            raise ValueError(f"a string without maxLength or pattern is unbounded: {schema}")
        return 2 + MAX_CHAR_BYTES * min(chars), 1
    if types in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        if low is None or high is None:
            raise ValueError(f"a number without both bounds is unbounded: {schema}")
        digits = max(len(str(int(low))), len(str(int(high)))) + 1  # a sign
        if types == "integer":
            return digits, 1
        if "multipleOf" not in schema:
            raise ValueError(f"a number without multipleOf has unbounded decimals: {schema}")
        decimals = len(repr(float(schema["multipleOf"])).partition(".")[2])
        return digits + 1 + decimals + 2, 1  # ".", and trailing zeros ("9.00" for 0.25)
    if types == "object":
        if schema.get("additionalProperties", True) is not False:
            raise ValueError(f"an object needs additionalProperties false: {schema}")
        members = [(len(_compact(key).encode()) + 1 + size, 2 + lexemes)  # "key" : value
                   for key, (size, lexemes) in ((key, _json_bounds(value, root))
                                                for key, value in schema.get("properties",
                                                                             {}).items())]
        return _container(members)
    if types == "array":
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", {})
        members = [_json_bounds(s, root) for s in prefix]
        if items is not False:
            if "maxItems" not in schema:
                raise ValueError(f"an array needs maxItems: {schema}")
            members += [_json_bounds(items, root)] * max(schema["maxItems"] - len(prefix), 0)
        return _container(members)
    raise ValueError(f"json_max_bytes does not know this schema: {schema}")


def _container(members: list[tuple[int, int]]) -> tuple[int, int]:
    """Bounds of an object or array of these members: brackets and commas around them."""
    commas = max(len(members) - 1, 0)
    return (2 + commas + sum(m[0] for m in members),
            2 + commas + sum(m[1] for m in members))


def _most(bounds: Any) -> tuple[int, int]:
    bounds = list(bounds)
    return max(b[0] for b in bounds), max(b[1] for b in bounds)


def _value_bounds(value: Any) -> tuple[int, int]:
    if isinstance(value, dict):
        members = [(len(_compact(k).encode()) + 1 + b[0], 2 + b[1])
                   for k, b in ((k, _value_bounds(v)) for k, v in value.items())]
        return _container(members)
    if isinstance(value, list):
        return _container([_value_bounds(v) for v in value])
    return len(_compact(value).encode()), 1


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _json_case_max_tokens(schema: dict, params: StructuredOutputsParams) -> int:
    compact, lexemes = _json_bounds(schema, schema)
    if params.disable_any_whitespace:
        gap = 0
    elif params.whitespace_pattern is not None:
        gap = regex_max_chars(params.whitespace_pattern)  # one match per gap, ASCII
    else:
        raise ValueError("JSON's default whitespace is unbounded: set disable_any_whitespace "
                         "or a bounded whitespace_pattern")
    return compact + gap * (lexemes - 1) + 1  # whitespace between lexemes only; EOS


# ---- checkers --------------------------------------------------------------------------------


def _fail(name: str, text: str, why: str) -> None:
    raise AssertionError(f"structured case {name!r}: {why}; output {text!r}")


def _whitespace_outside_strings(text: str) -> list[str]:
    """The runs of whitespace between JSON tokens (outside string literals)."""
    runs, current, in_string, escaped = [], "", False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch in " \t\n\r":
            current += ch
            continue
        if current:
            runs.append(current)
            current = ""
        in_string = ch == '"'
    if current:
        runs.append(current)
    return runs


def _json_checker(name: str, schema: dict, params: StructuredOutputsParams
                  ) -> Callable[[str], None]:
    validator = jsonschema.Draft202012Validator(schema)

    def check(text: str) -> None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            _fail(name, text, f"not JSON ({e})")
        errors = sorted(validator.iter_errors(value), key=lambda e: list(e.path))
        if errors:
            where = "/".join(map(str, errors[0].path)) or "the document"
            _fail(name, text, f"not valid for its schema at {where}: {errors[0].message}")
        runs = _whitespace_outside_strings(text)
        if params.disable_any_whitespace and runs:
            _fail(name, text, f"whitespace {runs[0]!r} with disable_any_whitespace")
        if params.whitespace_pattern is not None:
            bad = [r for r in runs if not re.fullmatch(params.whitespace_pattern, r)]
            if bad:
                _fail(name, text, f"whitespace {bad[0]!r} outside whitespace_pattern "
                                  f"{params.whitespace_pattern!r}")

    return check


def _regex_checker(name: str, pattern: str) -> Callable[[str], None]:
    compiled = re.compile(pattern)

    def check(text: str) -> None:
        if not compiled.fullmatch(text):
            _fail(name, text, f"does not fully match {pattern!r}")

    return check


def _choice_checker(name: str, choices: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        if text not in choices:
            _fail(name, text, f"not one of {choices}")

    return check


# ---- JSON schemas ----------------------------------------------------------------------------

_COMPACT = {"disable_any_whitespace": True}
_ONE_SPACE = {"whitespace_pattern": r"[ ]?"}  # at most one space between JSON tokens
_NEWLINE_INDENT = {"whitespace_pattern": r"\n?[ ]{0,2}"}


def _obj(properties: dict, required: list[str] | None = None, **extra: Any) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


def _int(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _str(max_length: int, **extra: Any) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


_POINT = _obj({"x": _int(-100, 100), "y": _int(-100, 100)})

JSON_SCHEMAS: dict[str, tuple[dict, dict]] = {  # name -> (schema, whitespace options)
    "person": (_obj({"name": _str(12), "age": _int(0, 120)}), _COMPACT),
    "point": (_POINT, _ONE_SPACE),
    "nested_user": (_obj({"id": _int(1, 9999), "profile": _obj({
        "name": _str(8), "active": {"type": "boolean"},
        "address": _obj({"city": _str(10), "zip": {"type": "string", "pattern": r"^[0-9]{5}$"}}),
    })}), _COMPACT),
    "int_list": ({"type": "array", "items": _int(0, 9), "minItems": 1, "maxItems": 4},
                 _COMPACT),
    "tags": (_obj({"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                            "minItems": 0, "maxItems": 3}}), _ONE_SPACE),
    "size_enum": ({"enum": ["small", "medium", "large"]}, _COMPACT),
    "mixed_enum": ({"enum": [1, "two", None, True, 3.5]}, _COMPACT),
    "int_enum": (_obj({"priority": {"type": "integer", "enum": [1, 2, 3, 5, 8]}}), _COMPACT),
    "prices": (_obj({
        "price": {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.5},
        "discount": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        "quantity": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
    }), _COMPACT),
    "temperature": ({"type": "number", "minimum": -40, "maximum": 50, "multipleOf": 0.25},
                    _COMPACT),
    "flags": (_obj({"a": {"type": "boolean"}, "b": {"type": "boolean"},
                    "c": {"type": "boolean"}}), _NEWLINE_INDENT),
    "optional_fields": (_obj({"id": _int(0, 999), "nickname": _str(6), "score": _int(0, 10),
                              "verified": {"type": "boolean"}}, required=["id"]), _COMPACT),
    "all_optional": (_obj({"note": _str(10), "count": _int(0, 50)}, required=[]), _COMPACT),
    "comment": (_obj({"comment": _str(16, minLength=1)}), _COMPACT),
    "codes": (_obj({"sku": {"type": "string", "pattern": r"^[A-Z]{3}-[0-9]{2}$"},
                    "word": _str(6, pattern=r"^[a-z]+$"),
                    "date": {"type": "string",
                             "pattern": r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"}}),
              _COMPACT),
    "any_of": (_obj({"value": {"anyOf": [_int(0, 9), _str(4), {"type": "null"}]}}), _ONE_SPACE),
    "one_of_shapes": ({"oneOf": [
        _obj({"kind": {"const": "circle"}, "r": _int(1, 99)}),
        _obj({"kind": {"const": "rect"}, "w": _int(1, 99), "h": _int(1, 99)}),
    ]}, _COMPACT),
    "const_fields": (_obj({"version": {"const": 2}, "kind": {"const": "point"},
                           "value": _int(0, 9)}), _COMPACT),
    "nullable": (_obj({"middle_name": {"type": ["string", "null"], "maxLength": 5},
                       "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 99}}),
                 _COMPACT),
    "todo_list": ({"type": "array", "maxItems": 3, "items": _obj(
        {"id": _int(0, 99), "title": _str(8), "done": {"type": "boolean"}})}, _COMPACT),
    "matrix": (_obj({"rows": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": _int(0, 9)}}}), _ONE_SPACE),
    "tuple": ({"type": "array", "prefixItems": [{"enum": ["GET", "POST"]}, _int(100, 599),
                                                 {"type": "boolean"}], "items": False},
              _COMPACT),
    "line_refs": ({"$defs": {"point": _POINT},
                   **_obj({"start": {"$ref": "#/$defs/point"},
                           "end": {"$ref": "#/$defs/point"}})}, _COMPACT),
    "product": (_obj({
        "name": _str(10, minLength=1),
        "price": {"type": "number", "minimum": 0, "maximum": 500, "multipleOf": 0.25},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": _str(5), "maxItems": 2},
        "dimensions": _obj({"w": _int(1, 100), "h": _int(1, 100)}),
    }, required=["name", "price", "in_stock"]), _NEWLINE_INDENT),
    "year": (_int(1900, 2100), _COMPACT),
}


def _json_case(name: str, schema: dict, options: dict) -> StructuredCase:
    params = StructuredOutputsParams(json=schema, **options)
    return StructuredCase(name, params, _json_checker(name, schema, params),
                          _json_case_max_tokens(schema, params))


JSON_CASES = [_json_case(f"json_{name}", schema, options)
              for name, (schema, options) in JSON_SCHEMAS.items()]

# ---- regexes (the common subset of Rust's regex syntax, which llguidance reads, and re's) -----

_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
REGEXES = {
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "iso_date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
    "email": r"[a-z]{1,8}(\.[a-z]{1,8})?@[a-z]{1,8}\.(com|org|net)",
    "hex_color": r"#[0-9a-fA-F]{6}",
    "assignment": r"[a-z_][a-z0-9_]{0,7} = (True|False|None|-?[0-9]{1,3})",
}


def _regex_case(name: str, pattern: str) -> StructuredCase:
    return StructuredCase(name, StructuredOutputsParams(regex=pattern),
                          _regex_checker(name, pattern), regex_max_chars(pattern) + 1)


REGEX_CASES = [_regex_case(f"regex_{name}", pattern) for name, pattern in REGEXES.items()]

# ---- choices ---------------------------------------------------------------------------------

CHOICES = {
    "yes_no": ["yes", "no"],
    "sentiment": ["positive", "negative", "neutral"],
    "cities": ["Paris", "New York", "São Paulo", "東京"],  # multi-byte characters
    "prefixes": ["a", "ab", "abc", "b"],  # one choice a prefix of another: EOS decides
}


def _choice_case(name: str, choices: list[str]) -> StructuredCase:
    return StructuredCase(name, StructuredOutputsParams(choice=choices),
                          _choice_checker(name, choices),
                          max(len(c.encode()) for c in choices) + 1)


CHOICE_CASES = [_choice_case(f"choice_{name}", choices) for name, choices in CHOICES.items()]

# ---- grammars (GBNF, llama.cpp's syntax; one Lark) -------------------------------------------

ARITHMETIC_GBNF = r"""
root   ::= expr
expr   ::= term (op term){0,2}
term   ::= number | "(" inner ")"
inner  ::= number (op number){1,2}
op     ::= "+" | "-" | "*" | "/"
number ::= "0" | [1-9] [0-9]{0,2}
"""
ARITHMETIC_MAX = 3 * (2 + 3 * 3 + 2) + 2  # 3 terms of ( n op n op n ), 2 ops between them


def _check_arithmetic(text: str) -> None:
    if not re.fullmatch(r"[0-9+\-*/()]+", text):
        _fail("grammar_arithmetic", text, "characters outside digits, + - * / and parentheses")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        _fail("grammar_arithmetic", text, f"not a Python expression ({e.msg})")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Expression, ast.BinOp, ast.Constant, ast.operator)):
            _fail("grammar_arithmetic", text, f"{type(node).__name__} in an arithmetic "
                                              "expression")
        if isinstance(node, ast.Constant) and type(node.value) is not int:
            _fail("grammar_arithmetic", text, f"the constant {node.value!r} is not an integer")
    depth = max(_paren_depths(text))
    if depth > 1:
        _fail("grammar_arithmetic", text, f"parentheses nested {depth} deep (the grammar: 1)")


def _paren_depths(text: str) -> list[int]:
    depth, depths = 0, [0]
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        depths.append(depth)
    return depths


KEY_VALUE_GBNF = r"""
root  ::= pair ("," pair){0,3}
pair  ::= key "=" value
key   ::= [a-z] [a-z_]{0,5}
value ::= "true" | "false" | "0" | [1-9] [0-9]{0,3}
"""
_PAIR = r"[a-z][a-z_]{0,5}=(true|false|0|[1-9][0-9]{0,3})"


def _check_key_value(text: str) -> None:
    if not re.fullmatch(rf"{_PAIR}(,{_PAIR}){{0,3}}", text):
        _fail("grammar_key_value", text, "not 1-4 comma-separated key=value pairs")


YES_NO_GBNF = r"""
root   ::= answer ("." | ", because " reason ".")
answer ::= "Yes" | "No"
reason ::= [a-z]{1,10} (" " [a-z]{1,10}){0,2}
"""


def _check_yes_no(text: str) -> None:
    if not re.fullmatch(r"(Yes|No)(\.|, because [a-z]{1,10}( [a-z]{1,10}){0,2}\.)", text):
        _fail("grammar_yes_no", text, "not 'Yes.'/'No.' or 'Yes, because <1-3 words>.'")


CSV_ROW_GBNF = r"""
root   ::= field ("," field){2,4}
field  ::= number | quoted
number ::= "0" | [1-9] [0-9]{0,2}
quoted ::= "\"" [a-z ]{0,6} "\""
"""


def _check_csv_row(text: str) -> None:
    try:
        rows = list(csv.reader([text], strict=True))
    except csv.Error as e:
        _fail("grammar_csv_row", text, f"not a CSV row ({e})")
    if len(rows) != 1 or not 3 <= len(rows[0]) <= 5:
        _fail("grammar_csv_row", text, "not one CSV row of 3-5 fields")
    field = r'(0|[1-9][0-9]{0,2}|"[a-z ]{0,6}")'
    if not re.fullmatch(rf"{field}(,{field}){{2,4}}", text):
        _fail("grammar_csv_row", text, "fields are not small integers or quoted lowercase text")


INT_LIST_LARK = r"""
start: "[" (INT (", " INT)~0..3)? "]"
INT: /(0|[1-9][0-9]{0,2})/
"""


def _check_int_list(text: str) -> None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        _fail("grammar_lark_int_list", text, f"not JSON ({e})")
    if not (isinstance(value, list) and len(value) <= 4
            and all(type(v) is int and 0 <= v <= 999 for v in value)):
        _fail("grammar_lark_int_list", text, "not a list of at most 4 integers in [0, 999]")
    if text != "[" + ", ".join(map(str, value)) + "]":
        _fail("grammar_lark_int_list", text, "not written as '[a, b]'")


GRAMMARS = {  # name -> (grammar, checker, most bytes of an output)
    "arithmetic": (ARITHMETIC_GBNF, _check_arithmetic, ARITHMETIC_MAX),
    "key_value": (KEY_VALUE_GBNF, _check_key_value, 4 * (6 + 1 + 5) + 3),
    "yes_no": (YES_NO_GBNF, _check_yes_no, 3 + len(", because ") + 3 * 10 + 2 + 1),
    "csv_row": (CSV_ROW_GBNF, _check_csv_row, 5 * 8 + 4),
    "lark_int_list": (INT_LIST_LARK, _check_int_list, 2 + 4 * 3 + 3 * 2),
}

GRAMMAR_CASES = [StructuredCase(f"grammar_{name}", StructuredOutputsParams(grammar=grammar),
                                check, max_bytes + 1)
                 for name, (grammar, check, max_bytes) in GRAMMARS.items()]

CASES: list[StructuredCase] = JSON_CASES + REGEX_CASES + CHOICE_CASES + GRAMMAR_CASES
CASES_BY_NAME: dict[str, StructuredCase] = {case.name: case for case in CASES}
assert len(CASES_BY_NAME) == len(CASES)

__all__ = ["CASES", "CASES_BY_NAME", "CHOICE_CASES", "GRAMMAR_CASES", "JSON_CASES",
           "JSON_SCHEMAS", "REGEX_CASES", "StructuredCase", "json_max_bytes", "max_tokens_for",
           "regex_max_chars"]
