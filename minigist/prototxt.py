"""Caffe's prototxt (protobuf text format), parsed and checked against Caffe's schema.

`parse_net(text, path)` returns a `Msg` tree. Every field is checked against `caffe_schema`:
an unknown field, a value of the wrong kind or a non-repeated field given twice is an error
naming the file and line. Messages we do not interpret (e.g. `python_param`) are kept opaque.
"""
import re

from .caffe_schema import SCHEMA, ENUMS
from .errors import ModelFileError

_TOKEN = re.compile(r"""
    (?P<ws>[ \t\r\f\v]+)
  | (?P<nl>\n)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>[-+]?(?:(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?[fF]?|(?i:inf(?:inity)?|nan)\b))
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<punct>[{}<>:;,\[\]])
""", re.VERBOSE)
_WORD_TAIL = re.compile(r"[A-Za-z0-9_.]*")


# deeper nesting than this is an error, not a RecursionError: Caffe's own model files nest a few
# levels (layer { convolution_param { weight_filler { } } }); protobuf's parsers stop at 100
MAX_DEPTH = 100

# Caffe's integer fields are int32 / uint32 (BlobShape's dims int64): the ranges a value must fit
INT_RANGES = {"int": (-2**31, 2**31 - 1), "uint": (0, 2**32 - 1), "int64": (-2**63, 2**63 - 1)}


class Msg:
    """One parsed message: fields in file order, each with the line it was written on."""

    __slots__ = ("type_name", "line", "fields")

    def __init__(self, type_name, line):
        self.type_name = type_name
        self.line = line
        self.fields = []  # (name, value, line)

    def has(self, name):
        return any(f[0] == name for f in self.fields)

    def get(self, name, default=None):
        for field_name, value, _ in self.fields:
            if field_name == name:
                return value
        return default

    def all(self, name):
        return [value for field_name, value, _ in self.fields if field_name == name]

    def line_of(self, name):
        for field_name, _, line in self.fields:
            if field_name == name:
                return line
        return self.line

    def __repr__(self):
        return f"Msg({self.type_name}, line {self.line}, {[f[0] for f in self.fields]})"


def _tokenize(text, path):
    tokens = []
    line = 1
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            if text[pos] in "\"'":
                raise ModelFileError(path, line, "unterminated string: a string must end on the line it starts")
            raise ModelFileError(path, line, f"unexpected character {text[pos]!r}")
        kind = match.lastgroup
        value = match.group(kind)
        if kind == "number":    # "3x" is one malformed number, not 3 and a field named x
            word = _WORD_TAIL.match(text, match.end()).group(0)
            if word:
                raise ModelFileError(path, line, f"malformed number {value + word!r}")
        if kind == "nl":
            line += 1
        elif kind not in ("ws", "comment"):
            tokens.append((kind, value, line))
        pos = match.end()
    tokens.append(("eof", "", tokens[-1][2] if tokens else 1))  # errors at the end point at the last line
    return tokens


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}


def _unescape(match):
    code = match.group(1)
    if code[0] in "xX":
        return chr(int(code[1:], 16))
    if code[0] in "01234567":
        return chr(int(code, 8))
    return _ESCAPES.get(code, code)


def _unquote(token):
    """The text of a quoted string, with protobuf's C escapes (\\n, \\", \\101, \\x41) resolved."""
    return re.sub(r"\\([xX][0-9A-Fa-f]{1,2}|[0-7]{1,3}|.)", _unescape, token[1:-1])


class _Parser:
    def __init__(self, text, path):
        self.path = path
        self.tokens = _tokenize(text, path)
        self.pos = 0

    def peek(self):
        return self.tokens[self.pos]

    def take(self):
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def fail(self, line, message):
        raise ModelFileError(self.path, line, message)

    def parse_message(self, type_name, line, closer, depth=0):
        if depth > MAX_DEPTH:
            self.fail(line, f"blocks nested more than {MAX_DEPTH} deep (Caffe's model files nest a few levels)")
        msg = Msg(type_name, line)
        fields = SCHEMA.get(type_name)  # None: an opaque message, any fields accepted
        seen = set()
        while True:
            kind, value, tok_line = self.peek()
            if kind == "eof":
                if closer != "eof":
                    self.fail(tok_line, f"missing '{closer}' at the end of the file for the block opened on line {line}")
                return msg
            if kind == "punct" and value == closer:
                self.take()
                return msg
            if kind == "punct" and value in ";,":
                self.take()
                continue
            if kind == "punct" and value in "}>":
                if closer == "eof":
                    self.fail(tok_line, f"'{value}' does not close any block")
                opener = "{" if closer == "}" else "<"
                self.fail(tok_line, f"'{value}' cannot close the block opened on line {line} with '{opener}'")
            if kind != "ident":
                self.fail(tok_line, f"expected a field name, found {value!r}")
            self.take()
            name = value
            spec, repeated = None, True
            if fields is not None:
                spec = fields.get(name)
                if spec is None:
                    self.fail(tok_line, f"unknown field '{name}' in {type_name}")
                repeated = spec.startswith("*")
                if not repeated and name in seen:
                    self.fail(tok_line, f"field '{name}' given twice in {type_name}")
                seen.add(name)
                spec = spec.lstrip("*")
            kind, value, value_line = self.peek()
            colon = kind == "punct" and value == ":"
            if colon:
                self.take()
                kind, value, value_line = self.peek()
            if kind == "punct" and value in "{<":
                msg.fields.append((name, self.parse_block(spec, name, tok_line, depth), tok_line))
            elif kind == "punct" and value == "[":
                self.take()
                if not repeated:
                    self.fail(tok_line, f"field '{name}' in {type_name} is not repeated: give one value, not a list")
                if spec in _SCALARS or spec in ENUMS:
                    self.need_colon(colon, name, tok_line)
                while True:
                    kind, value, value_line = self.peek()
                    if kind == "eof":
                        self.fail(value_line, f"missing ']' at the end of the file for the list opened on line {tok_line}")
                    if kind == "punct" and value in "],":
                        self.take()
                        if value == "]":
                            break
                    elif kind == "punct" and value in "{<":
                        msg.fields.append((name, self.parse_block(spec, name, value_line, depth), value_line))
                    else:
                        self.need_colon(colon, name, tok_line)
                        self.take()
                        msg.fields.append((name, self.convert(spec, kind, value, value_line, name, type_name), value_line))
            else:
                if kind not in ("eof", "punct"):
                    self.need_colon(colon, name, tok_line)
                self.take()
                msg.fields.append((name, self.convert(spec, kind, value, value_line, name, type_name), tok_line))

    def need_colon(self, colon, name, line):
        """Protobuf's text format, and so Caffe, reads `name: value` for a value that is no
        block (the colon is optional before a block only): Caffe refuses a file without it."""
        if not colon:
            self.fail(line, f"field '{name}' needs a ':' before its value ({name}: ...)")

    def parse_block(self, spec, name, line, depth):
        """The `{ ... }` or `< ... >` value of field `name`, its opener being the next token;
        `depth`: that of the message holding the field."""
        _, opener, _ = self.take()
        if spec is not None and (spec in _SCALARS or spec in ENUMS):
            self.fail(line, f"field '{name}' takes a value, not a block")
        return self.parse_message(spec if spec is not None else "?", line, "}" if opener == "{" else ">", depth + 1)

    def convert(self, spec, kind, value, line, name, type_name):
        if kind in ("eof", "punct"):
            self.fail(line, f"field '{name}' has no value")
        if spec is None:  # opaque message: keep raw text
            return _unquote(value) if kind == "string" else value
        if spec not in _SCALARS and spec not in ENUMS:  # a message type, checked or opaque
            self.fail(line, f"field '{name}' in {type_name} is a block: write {name} {{ ... }}")
        if spec == "string":
            if kind != "string":
                self.fail(line, f"field '{name}' takes a quoted string, found {value}")
            return _unquote(value)
        if spec == "bool":
            lowered = value.lower()
            if kind in ("ident", "number") and lowered in ("true", "false", "1", "0", "t", "f"):
                return lowered in ("true", "1", "t")
            self.fail(line, f"field '{name}' takes true or false, found {value}")
        if spec in INT_RANGES:
            if kind != "number":
                self.fail(line, f"field '{name}' takes an integer, found {value}")
            try:
                number = int(value)
            except ValueError:
                self.fail(line, f"field '{name}' takes an integer, found {value}")
            if spec == "uint" and number < 0:
                self.fail(line, f"field '{name}' cannot be negative, found {value}")
            low, high = INT_RANGES[spec]
            if not low <= number <= high:
                bits = {"int": "int32", "uint": "uint32", "int64": "int64"}[spec]
                self.fail(line, f"field '{name}' is {bits} in Caffe's schema: {value} is out of range "
                                f"({low:,} to {high:,})")
            return number
        if spec == "float":
            if kind != "number":
                self.fail(line, f"field '{name}' takes a number, found {value}")
            return float(value.rstrip("fF")) if not value.lower().startswith(("inf", "-inf", "+inf", "nan")) else float(value)
        if spec in ENUMS:
            allowed = ENUMS[spec]
            if kind == "string":
                value = _unquote(value)
            elif kind == "number" and value.isdigit():
                index = int(value)
                if index < len(allowed):
                    return allowed[index]
            if value not in allowed:
                self.fail(line, f"field '{name}' takes one of {', '.join(allowed)}; found {value}")
            return value
        raise AssertionError(f"schema type {spec} unknown")


_SCALARS = ("string", "bool", "int", "uint", "int64", "float")


def parse(text, path="<string>", root="NetParameter"):
    """Parse prototxt text into a `Msg` of type `root`, checked against the schema."""
    return _Parser(text, path).parse_message(root, 1, "eof")


def parse_file(path, root="NetParameter"):
    try:
        with open(path, "r", encoding="utf-8-sig") as handle:  # -sig: skip a BOM
            text = handle.read()
    except FileNotFoundError:
        raise ModelFileError(path, 0, "model file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFileError(path, 0, f"cannot read model file: {exc}") from None
    return parse(text, str(path), root)
