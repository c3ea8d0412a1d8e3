"""Consistent hashing (pure ring, no processes)."""

from matrixinfer.ems.ring import HashRing

KEYS = [f"key-{i}" for i in range(20000)]


def owners(ring):
    return {k: ring.lookup(k) for k in KEYS}


def test_adding_a_server_moves_about_one_over_n_plus_one_of_the_keys():
    """From 4 to 5 servers about 1/5 of the keys move (within a few percent), all to the new one."""
    ring = HashRing([f"s{i}" for i in range(4)])
    before = owners(ring)
    ring.add("s4")
    after = owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert abs(len(moved) / len(KEYS) - 1 / 5) < 0.04
    assert {after[k] for k in moved} == {"s4"}


def test_removing_a_server_remaps_only_its_keys():
    """Keys of the surviving servers keep their owner; only the removed server's keys move."""
    ring = HashRing([f"s{i}" for i in range(4)])
    before = owners(ring)
    ring.remove("s2")
    after = owners(ring)
    for k in KEYS:
        if before[k] != "s2":
            assert after[k] == before[k]
        else:
            assert after[k] != "s2"


def test_virtual_nodes_balance_the_load():
    """With 160 vnodes no server owns more than 1.3x its fair share."""
    ring = HashRing([f"s{i}" for i in range(4)])
    counts = {}
    for k in KEYS:
        counts[ring.lookup(k)] = counts.get(ring.lookup(k), 0) + 1
    assert max(counts.values()) < 1.3 * len(KEYS) / 4


def test_empty_ring_has_no_owner():
    """With no servers a lookup is None (the client turns it into a miss)."""
    assert HashRing().lookup("k") is None


def test_share_is_the_fraction_of_keys_a_server_owns():
    """Arc shares sum to 1 and match the fraction of 20,000 hashed keys each server gets."""
    ring = HashRing([f"s{i}" for i in range(3)])
    counts = {}
    for k in KEYS:
        counts[ring.lookup(k)] = counts.get(ring.lookup(k), 0) + 1
    assert abs(sum(ring.share(s) for s in ring.servers) - 1) < 1e-12
    for s in ring.servers:
        assert abs(counts[s] / len(KEYS) - ring.share(s)) < 0.02  # binomial sd ~0.0033
    assert HashRing(["only"]).share("only") == 1.0 and HashRing().share("x") == 0.0


def test_replica_holders_are_the_next_distinct_servers_and_survivors_keep_their_keys():
    """lookup_n gives the owner then distinct successors; removing a holder keeps the other
    holder of each of its keys in the list (so a read of that copy still finds it)."""
    ring = HashRing([f"s{i}" for i in range(4)])
    before = {k: ring.lookup_n(k, 2) for k in KEYS[:2000]}
    assert all(len(set(h)) == 2 and h[0] == ring.lookup(k) for k, h in before.items())
    assert ring.lookup_n("k", 9) and len(ring.lookup_n("k", 9)) == 4
    ring.remove("s1")
    for k, h in before.items():
        after = ring.lookup_n(k, 2)
        assert [s for s in h if s != "s1"] == [s for s in after if s in h]
    assert HashRing().lookup_n("k", 2) == []
