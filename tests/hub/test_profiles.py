"""The profile catalog parser: exact fractions, clear errors naming the field."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulab.hub.profiles import (
    DEFAULT_CATALOG,
    ProfileError,
    parse_catalog,
    parse_gpus,
    parse_memory_mib,
    parse_profile,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, Fraction(0)),
        ("1/8", Fraction(1, 8)),
        (0.25, Fraction(1, 4)),
        ("7/8", Fraction(7, 8)),
        (1, Fraction(1)),
        ("8", Fraction(8)),
        (Fraction(1, 2), Fraction(1, 2)),
    ],
)
def test_gpu_amounts_parse_exactly(value, expected):
    assert parse_gpus(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "is negative"),
        ("-1/4", "is negative"),
        (0.1, "not a multiple of 1/8 GPU"),
        ("1/3", "not a multiple of 1/8 GPU"),
        ("3/2", "mixes whole and fractional GPUs"),
        (1000, "more than 64 GPUs"),
        ("lots", "is not a GPU amount"),
        ("1/0", "divides by zero"),
        (None, "expected a number of GPUs"),
        (True, "expected a number of GPUs"),
        ([1], "expected a number of GPUs"),
    ],
)
def test_bad_gpu_amounts_are_refused_with_the_reason(value, message):
    with pytest.raises(ProfileError, match="gpus") as e:
        parse_gpus(value)
    assert message in str(e.value)


@given(st.one_of(st.text(max_size=12), st.integers(), st.floats(allow_nan=True), st.none()))
def test_gpu_parser_never_crashes_with_anything_but_profile_error(value):
    try:
        amount = parse_gpus(value)
    except ProfileError:
        return
    assert 0 <= amount <= 64
    assert amount < 1 and (amount * 8).denominator == 1 or amount.denominator == 1


def test_default_catalog_has_the_shapes_of_the_brief():
    catalog = parse_catalog(DEFAULT_CATALOG)
    assert [p.gpu_label for p in catalog] == [
        "CPU only",
        "1/8 GPU",
        "1/4 GPU",
        "1/2 GPU",
        "1 GPU",
        "2 GPUs",
        "4 GPUs",
        "8 GPUs",
    ]
    assert [(p.num_gpu, p.gpu_milli) for p in catalog][1:5] == [
        (0, 125),
        (0, 250),
        (0, 500),
        (1, 0),
    ]


def test_profile_fields_are_parsed_and_groups_restrict_visibility():
    p = parse_profile(
        {
            "slug": "a100-x2",
            "gpus": 2,
            "gpu_model": "A100-SXM4-80GB|H100-80GB-HBM3",
            "cpu_limit": 8,
            "mem_limit": "64G",
            "groups": ["staff"],
            "priority": "preemptible",
        },
        known_models={"A100-SXM4-80GB", "H100-80GB-HBM3"},
    )
    assert p.gpu_models == {"A100-SXM4-80GB", "H100-80GB-HBM3"}
    assert p.mem_limit_mib == 64 * 1024 and p.cpu_limit == 8.0
    assert p.visible_to({"staff"}) and not p.visible_to({"students"})
    assert p.visible_to(set(), is_admin=True)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"slug": "Bad Slug"}, "'slug' must be lower-case"),
        ({"slug": "x", "gpus": 1, "colour": "red"}, "unknown field(s) ['colour']"),
        ({"slug": "x", "gpus": 0, "gpu_model": "T4"}, "asks for no GPU"),
        (
            {"slug": "x", "gpus": 1, "gpu_model": "K80"},
            "gpu_model ['K80'] is not in the GPU inventory",
        ),
        ({"slug": "x", "cpu_limit": -2}, "cpu_limit must be a positive number"),
        ({"slug": "x", "mem_limit": "lots"}, "is not a size"),
        ({"slug": "x", "priority": "urgent"}, "priority must be one of"),
    ],
)
def test_bad_catalog_entries_name_the_field(entry, message):
    with pytest.raises(ProfileError) as e:
        parse_profile(entry, known_models={"T4"})
    assert message in str(e.value)


def test_catalog_refuses_duplicates_two_defaults_and_emptiness():
    with pytest.raises(ProfileError, match="appears twice"):
        parse_catalog([{"slug": "a"}, {"slug": "a"}])
    with pytest.raises(ProfileError, match="more than one default"):
        parse_catalog([{"slug": "a", "default": True}, {"slug": "b", "default": True}])
    with pytest.raises(ProfileError, match="empty"):
        parse_catalog([])


@pytest.mark.parametrize(
    ("value", "mib"),
    [("512M", 512), ("16G", 16384), ("16GiB", 16384), ("1T", 1048576), (2**30, 1024)],
)
def test_memory_sizes(value, mib):
    assert parse_memory_mib(value) == mib
