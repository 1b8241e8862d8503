"""kvrun.cluster.affinity: the prefix-affinity policy with its load bound, and the owners
map it reads, without a Ray cluster."""
from kvrun.cluster.affinity import Owners, choose
from kvrun.cluster.forward import BLOCK_CHARS, blocks_of


def test_affinity_follows_the_longest_owned_prefix():
    owners = Owners()
    sys_a, sys_b = blocks_of("a" * 4 * BLOCK_CHARS), blocks_of("b" * 2 * BLOCK_CHARS)
    idle = {"r1": 0, "r2": 0, "r3": 0}
    assert choose(sys_a, idle, owners, bound=2).kind == "cold"
    owners.record(sys_a, "r3")                      # r3 holds the longer prefix
    owners.record(sys_a[:2], "r2")                  # the last to take a block owns it
    c = choose(sys_a, idle, owners, bound=2)
    assert (c.replica, c.kind, c.blocks) == ("r3", "affinity", 4)
    assert choose(sys_a, {"r1": 0, "r2": 0}, owners, 2).replica == "r2"    # r3 gone
    assert choose(sys_b, idle, owners, 2).kind == "cold"
    owners.forget("r3")
    assert choose(sys_a, idle, owners, 2).replica == "r2"
    assert choose(sys_a, {"r1": 0}, owners, 2).kind == "cold"


def test_load_bound_spills_a_hot_prefix():
    owners = Owners()
    blocks = blocks_of("h" * 2 * BLOCK_CHARS)
    owners.record(blocks, "r1")
    assert choose(blocks, {"r1": 2, "r2": 0}, owners, bound=2).replica == "r1"   # at the bound
    c = choose(blocks, {"r1": 3, "r2": 0}, owners, bound=2)                       # past it
    assert (c.replica, c.kind) == ("r2", "spill")
    assert choose(blocks, {"r1": 1, "r2": 0}, owners, bound=0).replica == "r2"


def test_owners_forget_the_least_recently_used():
    owners = Owners(capacity=3)
    owners.record(["a", "b"], "r1")
    owners.record(["c", "d"], "r2")
    assert list(owners.map) == ["b", "c", "d"]
