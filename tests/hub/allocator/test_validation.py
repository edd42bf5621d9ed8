"""The allocator's inputs are checked where they enter: a bad budget or model list is a typed
error naming the field, never a quota silently switched off or an untyped error at place()."""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulab.hub.allocator import (
    GPU,
    Allocator,
    InvalidQuota,
    InvalidRequest,
    Inventory,
    NoCapacity,
    Node,
    Quota,
    QuotaExceeded,
    Request,
)
from gpulab.hub.capacity import GPUCapacity
from gpulab.hub.profiles import ProfileError

BAD_BUDGETS = [
    math.nan,
    math.inf,
    -math.inf,
    1.5,
    250.0,  # a float, even a whole one: milli are ints
    Fraction(1, 2),
    Fraction(250),
    True,
    -1,
    "250",
]
bad_budget = st.sampled_from(BAD_BUDGETS) | st.floats() | st.integers(max_value=-1)


@pytest.mark.parametrize("value", BAD_BUDGETS)
def test_a_bad_default_budget_is_refused_naming_the_field(value):
    with pytest.raises(InvalidQuota, match=r"Quota\.default_user_milli must be an int"):
        Quota(default_user_milli=value)


@settings(max_examples=200, deadline=None)
@given(value=bad_budget, kind=st.sampled_from(["users", "groups"]))
def test_any_bad_budget_in_a_table_is_refused_naming_the_key(value, kind):
    with pytest.raises(InvalidQuota, match=rf"Quota\.{kind}\['x'\]"):
        Quota(**{kind: {"x": value}})
    assert issubclass(InvalidQuota, ValueError)  # callers catching ValueError still do


@settings(max_examples=100, deadline=None)
@given(
    budget=st.integers(0, 4000),
    asks=st.lists(st.sampled_from([125, 250, 500, 1000, 2000]), max_size=20),
)
def test_a_finite_budget_is_never_exceeded_and_refusals_are_typed(budget, asks):
    node = Node("n", 64_000, 262_144, tuple(GPU(f"n-{i}", "A100", index=i) for i in range(8)))
    alloc = Allocator(Inventory([node]), quota=Quota(default_user_milli=budget))
    for i, milli in enumerate(asks):
        req = Request(
            f"u/{i}",
            owner="u",
            num_gpu=milli // 1000,
            gpu_milli=milli % 1000 if milli < 1000 else 0,
        )
        with contextlib.suppress(QuotaExceeded):
            alloc.place(req)
        assert alloc.usage_milli("u") <= budget
        assert alloc.quota_left_milli("u", frozenset()) == budget - alloc.usage_milli("u")


def test_a_model_list_given_as_a_string_is_refused_not_split_into_letters():
    with pytest.raises(InvalidRequest, match=r"gpu_models must be a set of names.*'A100'"):
        Request("u/1", gpu_milli=250, gpu_models="A100")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="groups must be a set of names"):
        Request("u/1", groups="staff")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="non-empty strings"):
        Request("u/1", gpu_models={"A100", ""})
    assert Request("u/1", gpu_models=["A100"]).gpu_models == frozenset({"A100"})


@pytest.mark.parametrize("value", [math.inf, "inf", math.nan, "nan", -1, "x", [1]])
def test_the_hubs_quota_options_name_themselves(value):
    # inf used to stop the hub with a bare OverflowError naming no option
    with pytest.raises(ProfileError, match="GPUCapacity.default_user_quota_gpus"):
        GPUCapacity(default_user_quota_gpus=value)._quota()  # what the hub builds at start


def test_a_budget_that_is_an_integral_but_not_an_int_is_stored_as_an_int():
    numpy = pytest.importorskip("numpy")
    quota = Quota(users={"a": numpy.int64(1500)}, default_user_milli=numpy.uint16(250))
    assert type(quota.users["a"]) is int and quota.users["a"] == 1500
    assert type(quota.default_user_milli) is int and quota.default_user_milli == 250


@pytest.mark.parametrize("key", [None, "", 7])
def test_a_budget_table_keyed_by_something_other_than_a_name_is_refused(key):
    with pytest.raises(InvalidQuota, match=r"Quota\.groups: keys must be non-empty names"):
        Quota(groups={key: 1000})


@pytest.mark.parametrize("value", [None, 5, [["A100"]]])
def test_a_model_list_that_is_no_collection_of_names_is_a_typed_refusal(value):
    with pytest.raises(InvalidRequest, match="gpu_models must be a set of names"):
        Request("u/1", gpu_milli=250, gpu_models=value)


USERS = ("ann", "bob", "cid")
GROUPS = ("lab", "class")
valid_budget = st.integers(0, 3000)


@settings(max_examples=100, deadline=None)
@given(
    users=st.dictionaries(st.sampled_from(USERS), valid_budget),
    groups=st.dictionaries(st.sampled_from(GROUPS), valid_budget),
    default=st.none() | valid_budget,
    asks=st.lists(
        st.tuples(
            st.sampled_from(USERS),
            st.frozensets(st.sampled_from(GROUPS)),
            st.sampled_from([0, 125, 250, 500, 1000, 2000]),
            st.booleans(),  # release the user's oldest server instead of asking
        ),
        max_size=30,
    ),
)
def test_valid_budgets_never_make_place_raise_anything_but_a_refusal_nor_let_anyone_over(
    users, groups, default, asks
):
    node = Node("n", 64_000, 262_144, tuple(GPU(f"n-{i}", "A100", index=i) for i in range(4)))
    quota = Quota(users=users, groups=groups, default_user_milli=default)
    alloc = Allocator(Inventory([node]), quota=quota)
    held: dict[str, list[tuple[str, frozenset[str], int]]] = {u: [] for u in USERS}
    for i, (user, member_of, milli, release) in enumerate(asks):
        if release and held[user]:
            alloc.release(held[user].pop(0)[0])
            continue
        req = Request(
            f"{user}/{i}",
            owner=user,
            groups=member_of,
            num_gpu=milli // 1000,
            gpu_milli=milli if milli < 1000 else 0,
        )
        try:
            alloc.place(req)
        except (QuotaExceeded, NoCapacity):
            continue  # refusals are typed; anything else fails the test
        held[user].append((req.id, member_of, milli))
    for user in USERS:
        limit = quota.user_limit(user)
        assert limit is None or alloc.usage_milli(user) <= limit
    for group, limit in groups.items():
        assert sum(m for h in held.values() for _, g, m in h if group in g) <= limit


@pytest.mark.parametrize(("value", "milli"), [(1.1, 1100), (0.3, 300), ("3/8", 375), (2, 2000)])
def test_the_hubs_quota_options_read_a_float_as_the_decimal_it_prints_as(value, milli):
    # Fraction(1.1) is 1.100000000000000088..., which used to be refused as finer than 1/1000
    quota = GPUCapacity(user_quota_gpus={"a": value}, default_user_quota_gpus=value)._quota()
    assert quota.users["a"] == milli and quota.default_user_milli == milli
