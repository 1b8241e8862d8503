"""kvrun.engine.prefix_tier: the PrefixTier contract. Both second-level stores, the disk tier
and the cluster's shared tier, offer each of its methods with its arity and defaults (the
prefix cache calls them positionally), so either can stand behind a PrefixCache."""
import inspect

import pytest

from kvrun.engine.prefix_disk import DiskTier
from kvrun.engine.prefix_tier import PrefixTier

METHODS = ("paths", "get", "put", "remove", "stats")


def _shape(fn):
    """(number of parameters, their defaults) of a method, self included."""
    ps = inspect.signature(fn).parameters.values()
    return len(ps), [p.default for p in ps]


def _tiers():
    yield DiskTier
    try:
        from kvrun.cluster.shared_tier import SharedTier
    except ImportError:                 # ray not installed: the disk tier alone
        return
    yield SharedTier


def test_the_contract_names_what_the_prefix_cache_calls():
    assert [n for n in METHODS if callable(getattr(PrefixTier, n, None))] == list(METHODS)
    assert _shape(PrefixTier.get) == (5, [inspect.Parameter.empty] * 4 + [None])


@pytest.mark.parametrize("tier", list(_tiers()), ids=lambda t: t.__name__)
def test_each_tier_offers_the_contract(tier):
    for name in METHODS:
        assert _shape(getattr(tier, name)) == _shape(getattr(PrefixTier, name)), name
