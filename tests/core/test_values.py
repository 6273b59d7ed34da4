"""The kinds of setting values: one parse and one TOML type check per kind, shared by flags, variables,
TOML keys and API keywords. Pure: no click, no torch."""

import math

import pytest

from pipeline.core import values


@pytest.mark.parametrize("kind, given, parsed", [
    (values.Integer(1), "64", 64), (values.Integer(1), 64.0, 64), (values.Integer(), "-3", -3),
    (values.Number(1.0, 4.0), "2", 2.0), (values.Number(0, low_open=True), 0.5, 0.5),
    (values.CountOrAuto("rows"), "AUTO", None), (values.CountOrAuto("workers", minimum=0), "0", 0),
    (values.Size(), "4GiB", 4 * 2**30), (values.Duration(), "2m", 120.0), (values.Duration(), 30, 30.0),
    (values.Names(), " label, lang ,", ("label", "lang")), (values.Names(), ["a"], ("a",)),
    (values.IntegerList(), "512,1024", (512, 1024)), (values.OneOf("on", "off"), "on", "on"),
    (values.Flag(), "off", False), (values.Flag(), True, True), (values.Text(), 3, "3"),
])
def test_a_good_value_parses_to_what_the_config_holds(kind, given, parsed):
    assert kind.parse(given) == parsed


@pytest.mark.parametrize("kind, given, message", [
    (values.Integer(1), "0", "0 is not in the range x>=1."),
    (values.Integer(1), 64.5, "64.5 is not a valid integer range."),
    (values.Integer(), True, "True is not a valid integer."),
    (values.Number(1.0, 4.0), "nan", "'nan' is not a finite number; give one in 1.0<=x<=4.0"),
    (values.Number(1.0, 4.0), math.inf, "inf is not a finite number; give one in 1.0<=x<=4.0"),
    (values.Number(0, low_open=True), 0, "0.0 is not in the range x>0."),
    (values.CountOrAuto("rows"), "0", "0 is not a positive number of rows"),
    (values.CountOrAuto("tokens"), "lots", "'lots' is neither a number of tokens nor 'auto'"),
    (values.Duration(), "-5s", "'-5s' is negative"),
    (values.Names(), ",", "',' names nothing; give comma-separated names"),
    (values.IntegerList(), "0,4", "'0,4' needs at least one positive integer"),
    (values.OneOf("auto", "on"), "of", "'of' is not one of 'auto', 'on'."),
    (values.Flag(), "maybe", "'maybe' is not a valid boolean."),
])
def test_a_bad_value_says_what_is_wrong_with_it(kind, given, message):
    with pytest.raises(ValueError) as raised:
        kind.parse(given)
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize("kind, value, multiple, problem", [
    (values.Text(), ["a", "b"], False, "is a list, but it takes a string"),
    (values.Integer(1), 64.7, False, "is a float, but it takes an integer"),
    (values.Integer(1), True, False, "is a boolean, but it takes an integer"),
    (values.Number(1.0, 4.0), 2, False, None),  # an integer where a number goes
    (values.CountOrAuto("rows"), "auto", False, None),
    (values.Flag(), "no", False, "is a string, but it takes a boolean (true or false)"),
    (values.Text(), [1, 2], True, "holds an integer, but it takes a list of strings or a string"),
    (values.Text(), "one", True, None),
    (values.Names(), [1], False, "holds an integer, but it takes a list of strings or a string"),
    (values.IntegerList(), [512, "x"], False, "holds a string, but it takes a list of integers or a string"),
    (values.OneOf("auto", "on", "off"), False, False, 'is a boolean, but it takes one of "auto", "on", "off"'),
])
def test_a_toml_value_of_the_wrong_type_is_named_never_coerced(kind, value, multiple, problem):
    assert kind.toml_problem(value, multiple) == problem
