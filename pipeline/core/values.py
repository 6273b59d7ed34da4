"""What a setting takes, checked once whether it comes from a flag, a LENGTHWISE_* variable, a TOML
key or a keyword of `pipeline.api.run`: each kind parses a value or raises ValueError with the
message the user reads. The CLI wraps them as click types (`pipeline.cli.options.Checked`)."""

from __future__ import annotations

import json
import math

BOOLEAN_STATES = {"1": True, "0": False, "yes": True, "no": False, "true": True, "false": False, "on": True,
                  "off": False, "t": True, "f": False, "y": True, "n": False, "": False}  # click's, for env values

TOML_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list",
                   dict: "a table"}


def toml_type_name(value) -> str:
    return next((name for kind, name in TOML_TYPE_NAMES.items() if isinstance(value, kind)), "a date or time")


def _fits(value, kinds: tuple) -> bool:
    return isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))


class Kind:
    """A setting's kind: `parse` a value of it. For a TOML file: the types it may hold (`toml_types`; a
    list's items: `items`), in words (`expected`), and `plural` for a list of it (a repeatable option)."""

    metavar = "TEXT"
    toml_types: tuple = (str,)
    items: tuple | None = None
    expected, plural = "a string", "strings"

    def parse(self, value):
        return value if isinstance(value, str) else str(value)

    def toml_problem(self, value, multiple: bool = False) -> str | None:
        """What is wrong with the type of a TOML value ("is a list, but it takes a string"), or None.
        Never coerced: `output = ["a", "b"]` would be a folder named "['a', 'b']" and
        `max_batch_rows = 64.7` would be 64. An integer where a float goes is fine."""
        if multiple:
            allowed, items, expected = (list, str), self.toml_types, f"a list of {self.plural} or a string"
        else:
            allowed, items, expected = self.toml_types, self.items, self.expected
        if not _fits(value, allowed):
            return f"is {toml_type_name(value)}, but it takes {expected}"
        wrong = [v for v in value if not _fits(v, items)] if isinstance(value, list) and items else []
        if wrong:
            return f"holds {toml_type_name(wrong[0])}, but it takes {expected}"
        return None


class Text(Kind):
    """Any string (a path, a URL, a name)."""


class Flag(Kind):
    """True or False; from an environment variable one of click's spellings (1, true, yes, on …)."""

    metavar, toml_types, expected = "BOOLEAN", (bool,), "a boolean (true or false)"

    def parse(self, value):
        if isinstance(value, bool):
            return value
        state = BOOLEAN_STATES.get(str(value).strip().lower())
        if state is None:
            raise ValueError(f"{value!r} is not a valid boolean. Recognized values: {', '.join(sorted(BOOLEAN_STATES))}")
        return state


def _integer(value, name: str) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{value!r} is not a valid {name}.")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a valid {name}.") from None


def describe_range(low, high, low_open: bool = False) -> str:
    """click's words for a range: x>=1, x>0, 1.0<=x<=4.0."""
    if high is None:
        return f"x{'>' if low_open else '>='}{low}"
    if low is None:
        return f"x<={high}"
    return f"{low}{'<' if low_open else '<='}x<={high}"


class Integer(Kind):
    """An integer, at least `minimum` when given."""

    toml_types, expected = (int,), "an integer"

    def __init__(self, minimum: int | None = None):
        self.minimum = minimum
        self.metavar = "INTEGER" if minimum is None else f"INTEGER {describe_range(minimum, None)}"

    def parse(self, value):
        number = _integer(value, "integer" if self.minimum is None else "integer range")
        if self.minimum is not None and number < self.minimum:
            raise ValueError(f"{number} is not in the range {describe_range(self.minimum, None)}.")
        return number


class Number(Kind):
    """A finite number within [low, high] (low excluded with `low_open`): nan passes every comparison of a
    range check and of what the value feeds (`--safety nan` turned the memory plan off), so it is refused."""

    toml_types, expected = (int, float), "a number"

    def __init__(self, low=None, high=None, low_open: bool = False):
        self.low, self.high, self.low_open = low, high, low_open
        self.metavar = f"FLOAT {describe_range(low, high, low_open)}"

    def parse(self, value):
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a valid float range.")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{value!r} is not a valid float range.") from None
        described = describe_range(self.low, self.high, self.low_open)
        if not math.isfinite(number):
            raise ValueError(f"{value!r} is not a finite number; give one in {described}")
        below = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        if below or (self.high is not None and number > self.high):
            raise ValueError(f"{number} is not in the range {described}.")
        return number


class OneOf(Kind):
    """One of a fixed set of words."""

    def __init__(self, *choices: str):
        self.choices = choices
        self.metavar = f"[{'|'.join(choices)}]"
        self.expected = f"one of {', '.join(json.dumps(choice) for choice in choices)}"

    def parse(self, value):
        if value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(map(repr, self.choices))}.")
        return value


class CountOrAuto(Kind):
    """A positive count of tokens or rows, or `auto` (None): the sweep's recommendation or the memory
    plan decides."""

    toml_types, expected = (int, str), 'an integer or "auto"'

    def __init__(self, unit: str, minimum: int = 1):
        self.unit, self.minimum = unit, minimum
        self.metavar = f"{unit.upper()}|AUTO"

    def parse(self, value):
        if value is None or (isinstance(value, str) and value.lower() == "auto"):
            return None
        try:
            count = _integer(value, "count")
        except ValueError:
            raise ValueError(f"{value!r} is neither a number of {self.unit} nor 'auto'") from None
        if count < self.minimum:
            raise ValueError(f"{count} is not a positive number of {self.unit}" if self.minimum == 1 else
                             f"{count} is below {self.minimum}, the fewest {self.unit}")
        return count


class Size(Kind):
    """A size such as 4GiB, 512MiB or 2GB, as bytes."""

    metavar, toml_types, expected = "SIZE", (int, str), 'a size (bytes, or a string such as "4GiB")'

    def parse(self, value):
        from pipeline.core.units import parse_bytes

        return parse_bytes(value)


class Duration(Kind):
    """Seconds, as 30s, 500ms, 2m, 4h or a bare number of seconds."""

    metavar, toml_types, expected = "DURATION", (int, float, str), 'seconds, or a string such as "30s"'
    UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

    def parse(self, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            text = str(value).strip().lower()
            unit = next((u for u in ("ms", "s", "m", "h") if text.endswith(u)), "")
            try:
                seconds = float(text[:len(text) - len(unit)]) * self.UNITS.get(unit, 1.0)
            except ValueError:
                raise ValueError(f"{value!r} is not a duration such as 30s, 500ms or 2m") from None
        if not math.isfinite(seconds):
            raise ValueError(f"{value!r} is not a finite duration; give one such as 30s, 500ms or 2m")
        if seconds < 0:
            raise ValueError(f"{value!r} is negative")
        return seconds


class CommaSeparated(Kind):
    """Items given as a list, or as comma-separated text ("a, b,c": stripped, empty parts dropped)."""

    def parse(self, value):
        if isinstance(value, (list, tuple)):
            return tuple(value)  # already items (a TOML list's are checked by `toml_problem`)
        return self.parse_parts(tuple(part.strip() for part in str(value).split(",") if part.strip()), value)

    def parse_parts(self, parts: tuple[str, ...], value) -> tuple:
        """The value of the text `value` cut into `parts`; ValueError says what is wrong."""
        raise NotImplementedError


class Names(CommaSeparated):
    """Comma-separated names (a list too): offensive,hate."""

    metavar, toml_types, items, expected = "NAME,NAME,…", (list, str), (str,), "a list of strings or a string"

    def parse_parts(self, parts, value):
        if not parts:
            raise ValueError(f"{value!r} names nothing; give comma-separated names")
        return parts


class IntegerList(CommaSeparated):
    """Comma-separated positive integers (a list too): 512,1024,2048."""

    metavar, toml_types, items, expected = "N,N,…", (list, str), (int,), "a list of integers or a string"

    def parse_parts(self, parts, value):
        try:
            numbers = tuple(int(part) for part in parts)
        except ValueError:
            raise ValueError(f"{value!r} is not a comma-separated list of integers, e.g. 1024,2048,4096") from None
        if not numbers or min(numbers) < 1:
            raise ValueError(f"{value!r} needs at least one positive integer")
        return numbers


class ModelTables(Kind):
    """Several models by name, each a table of its settings: a TOML [models.NAME] table, a dict in the API,
    or on the command line the inside of a TOML inline table:
    'toxicity = {job = "moderate", model = "models/tox"}, embed = {job = "embed"}'. Only the shape and the
    names are checked here; each table's keys are the run options' (offline/model_set.py)."""

    metavar, toml_types, expected = "NAME={KEY=VALUE,…},…", (dict, str), "a table of [models.NAME] tables"

    def parse(self, value):
        if isinstance(value, str):
            import tomllib

            try:
                value = tomllib.loads(f"models = {{{value}}}")["models"]
            except tomllib.TOMLDecodeError as error:
                raise ValueError(f"{value!r} is not NAME = {{KEY = VALUE, …}}, … in TOML's inline-table form, e.g. "
                                 "'toxicity = {job = \"moderate\", model = \"models/tox\"}' ("
                                 f"{error})") from None
        if not isinstance(value, dict):
            raise ValueError(f"is {toml_type_name(value)}, but it takes {self.expected}")
        for name, table in value.items():
            if not isinstance(name, str) or not name or any(mark in name for mark in ".:") or name != name.strip():
                raise ValueError(f"model name {name!r}: a name may not be empty or hold '.' or ':' (they separate it "
                                 "from its column names and labels); rename it")
            if not isinstance(table, dict):
                raise ValueError(f"models.{name} is {toml_type_name(table)}, but it takes a table of its settings "
                                 "(job, model, thresholds, …)")
        return {name: dict(table) for name, table in value.items()}


class FilePath(Text):
    """A file's path (a CSV, a plot): the CLI's option also refuses an existing directory (click.Path)."""

    metavar = "FILE"
