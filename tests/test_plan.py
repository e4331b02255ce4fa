"""The packing engine: validity and determinism of every algorithm, each algorithm's rule against a plain
reference loop, hand-checked cases, fill under a segment cap, and data-parallel balance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packtool.errors import ConfigError
from packtool.packer.algorithms import (
    ALGORITHMS,
    balance_dp,
    compare,
    derive_align,
    dp_imbalance,
    l1_bound,
    pack_lengths,
)
from packtool.packer.algorithms._common import decreasing_order
from packtool.packer.algorithms._rows import place_by_rows
from packtool.packer.algorithms._tree import NEG, MaxTree
from packtool.packer.algorithms.bestfit import bfd_by_cost
from packtool.packer.algorithms.fill import _fill_by_cost, _fill_by_item
from packtool.packer.algorithms.firstfit import ffd_by_cost, first_fit

# -- reference loops: each algorithm's rule written as plainly as possible (O(items * packs)) ---------------


def _decreasing(units):
    return sorted(range(len(units)), key=lambda i: (-units[i], i))


def _fits(p, i, units, cap, K, res, rem, segs, held):
    return (rem[p] >= units[i] and (K is None or segs[p] < K)
            and all(held[j][p] + v[i] <= lim for j, (v, lim) in enumerate(res)))


def _place_each(units, cap, K, res, order, choose, start=0):
    """Items in ``order``; ``choose(candidates, rem, segs)`` picks among packs the item fits, else a new pack."""
    rem, segs, held = [cap] * start, [0] * start, [[0] * start for _ in res]
    ids = [0] * len(units)
    for i in order:
        cand = [p for p in range(len(rem)) if _fits(p, i, units, cap, K, res, rem, segs, held)]
        if cand:
            p = choose(cand, rem, segs)
        else:
            p = len(rem)
            rem.append(cap)
            segs.append(0)
            for h in held:
                h.append(0)
        rem[p] -= units[i]
        segs[p] += 1
        for j, (v, _) in enumerate(res):
            held[j][p] += v[i]
        ids[i] = p
    return ids


def _dense(ids):
    keep = sorted(set(ids))
    return [keep.index(p) for p in ids]


def ref_fill(units, cap, K, res, balanced):
    pool = _decreasing(units)
    estimate = max(-(-sum(units) // cap), -(-len(units) // K)) if balanced else 0
    ids, p = [0] * len(units), 0
    while pool:
        nt = min(K, max(1, -(-len(pool) // max(1, estimate - p)))) if balanced else 0
        room, k, held, x = cap, 0, [0] * len(res), cap

        def best(limit, held):
            return next((i for i in pool if units[i] <= limit
                         and all(h + v[i] <= lim for h, (v, lim) in zip(held, res))), None)

        while True:
            i = best(x, held)
            if i is None and x < room:
                i = best(room, held)
            if i is None:
                break
            pool.remove(i)
            ids[i] = p
            room -= units[i]
            held = [h + v[i] for h, (v, _) in zip(held, res)]
            k += 1
            if K and k >= K:
                break
            x = room // (nt - k) if balanced and nt - k >= 2 else room
        p += 1
    return ids


def ref_bfd(units, cap, K, res):
    return _place_each(units, cap, K, res, _decreasing(units),
                       lambda c, rem, segs: min(c, key=lambda p: (rem[p], (K - segs[p]) if K else 0, p)))


def ref_auto(units, cap, K, res, seed=0):
    first = lambda c, rem, segs: c[0]
    ids = ref_bfd(units, cap, K, res)
    binding = [(v, lim) for v, lim in res if sum(sorted(v, reverse=True)[:K] if K else v) > lim]
    if K and ids and max(np.bincount(ids)) >= K:
        alt = ref_fill(units, cap, K, binding, balanced=True)
        if max(alt) < max(ids):
            ids = alt
    if binding and ids:  # a binding image cap: a shuffled first fit competes
        alt = _place_each(units, cap, K, res, np.random.default_rng(seed).permutation(len(units)).tolist(), first)
        if max(alt) < max(ids):
            return alt
    return ids


def ref_pack(algorithm, units, cap, K, res, seed=0, delta=0):
    first = lambda c, rem, segs: c[0]
    if algorithm == "auto":
        return ref_auto(units, cap, K, res, seed)
    if algorithm == "bfd":
        return ref_bfd(units, cap, K, res)
    if algorithm == "ffd":
        return _place_each(units, cap, K, res, _decreasing(units), first)
    if algorithm == "first_fit_shuffle":
        return _place_each(units, cap, K, res, np.random.default_rng(seed).permutation(len(units)).tolist(), first)
    if algorithm == "greedy_knapsack":
        return ref_fill(units, cap, K, res, balanced=False)
    if algorithm == "balanced_greedy_knapsack":
        start = max(1, -(-sum(units) // cap) + delta)
        return _dense(_place_each(units, cap, K, res, _decreasing(units),
                                  lambda c, rem, segs: min(c, key=lambda p: (-rem[p], p)), start))
    assert algorithm == "sequential"
    ids, p, room, k, held = [], 0, cap, 0, [0] * len(res)
    for i, u in enumerate(units):
        if u > room or (K and k == K) or any(h + v[i] > lim for h, (v, lim) in zip(held, res)):
            p, room, k, held = p + 1, cap, 0, [0] * len(res)
        ids.append(p)
        room, k, held = room - u, k + 1, [h + v[i] for h, (v, _) in zip(held, res)]
    return ids


# -- problems ----------------------------------------------------------------------------------------------


@st.composite
def problems(draw, max_items=40):
    align = draw(st.integers(1, 4))
    pack_size = draw(st.integers(align, 120))
    top = pack_size // align * align
    n = draw(st.integers(0, max_items))
    small = draw(st.booleans())  # few distinct lengths: exercises equal costs and repeated packs
    hi = min(top, 6) if small else top
    lengths = draw(st.lists(st.integers(1, hi), min_size=n, max_size=n))
    kw = {"align": align, "max_segments": draw(st.one_of(st.none(), st.integers(1, 6)))}
    if draw(st.booleans()):
        kw["max_images"] = draw(st.integers(1, 4))
        kw["images"] = draw(st.lists(st.integers(0, kw["max_images"]), min_size=n, max_size=n))
    if draw(st.booleans()):
        kw["max_image_tokens"] = draw(st.integers(10, 60))
        kw["image_tokens"] = draw(st.lists(st.integers(0, kw["max_image_tokens"]), min_size=n, max_size=n))
    return lengths, pack_size, kw


def _resources(kw, n):
    res = []
    for values, limit in (("images", "max_images"), ("image_tokens", "max_image_tokens")):
        if kw.get(limit) is not None:
            res.append((list(kw[values]), kw[limit]))
    return res


def assert_valid(ids, lengths, pack_size, align=1, max_segments=None, images=None, max_images=None,
                 image_tokens=None, max_image_tokens=None):
    ids = np.asarray(ids)
    assert ids.dtype == np.int64 and ids.shape == (len(lengths),)
    if not len(lengths):
        return
    n_packs = int(ids.max()) + 1
    assert ids.min() == 0 and np.array_equal(np.unique(ids), np.arange(n_packs)), "packs 0..P-1, none empty"
    cost = -(-np.asarray(lengths) // align) * align
    assert np.bincount(ids, weights=cost).max() <= pack_size
    if max_segments:
        assert np.bincount(ids).max() <= max_segments
    if max_images is not None:
        assert np.bincount(ids, weights=images).max() <= max_images
    if max_image_tokens is not None:
        assert np.bincount(ids, weights=image_tokens).max() <= max_image_tokens


FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(problems(), st.sampled_from(ALGORITHMS), st.integers(0, 3), st.integers(0, 2))
def test_every_algorithm_valid_deterministic_and_follows_its_rule(problem, algorithm, seed, delta):
    lengths, pack_size, kw = problem
    ids = pack_lengths(lengths, pack_size, algorithm=algorithm, seed=seed, balanced_delta=delta, **kw)
    assert_valid(ids, lengths, pack_size, **kw)
    again = pack_lengths(np.asarray(lengths), pack_size, algorithm=algorithm, seed=seed, balanced_delta=delta,
                         **kw)
    assert np.array_equal(ids, again)
    units = [-(-x // kw["align"]) for x in lengths]
    want = ref_pack(algorithm, units, pack_size // kw["align"], kw["max_segments"], _resources(kw, len(lengths)),
                    seed, delta)
    assert ids.tolist() == want


@FAST
@given(problems(), st.data())
def test_copies_of_one_sample_never_share_a_pack(problem, data):
    """``samples`` (a mixture's copies): under every constraint, bfd never puts two copies of one sample in one
    pack, and without copies (all -1) it packs exactly as without ``samples``."""
    lengths, pack_size, kw = problem
    n = len(lengths)
    samples = np.asarray(data.draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n)), np.int64)
    ids = pack_lengths(lengths, pack_size, algorithm="bfd", samples=samples, **kw)
    assert_valid(ids, lengths, pack_size, **kw)
    copied = samples >= 0
    pairs = list(zip(ids[copied].tolist(), samples[copied].tolist()))
    assert len(pairs) == len(set(pairs))
    none = pack_lengths(lengths, pack_size, algorithm="bfd", samples=np.full(n, -1), **kw)
    units = [-(-x // kw["align"]) for x in lengths]
    assert none.tolist() == ref_pack("bfd", units, pack_size // kw["align"], kw["max_segments"],
                                     _resources(kw, n))


def test_copies_spread_over_rounds_fill_like_plain_best_fit():
    """Many copies of a few short samples beside long ones: spread over rounds, best fit keeps them apart at about
    plain best fit's pack count (within 3 %); in plain decreasing order with the same rule the copies of the last,
    shortest samples open packs of their own (control)."""
    rng = np.random.default_rng(0)
    long = rng.integers(300, 1800, 300)
    short = np.repeat(rng.integers(80, 120, 20), 50)  # 20 captions, 50 copies each
    lengths = np.concatenate([long, short])
    samples = np.concatenate([np.full(long.size, -1), np.repeat(np.arange(20), 50)])
    plain = pack_lengths(lengths, 2048, algorithm="bfd")
    apart = pack_lengths(lengths, 2048, algorithm="bfd", samples=samples)
    assert len(set(zip(apart[samples >= 0].tolist(), samples[samples >= 0].tolist()))) == short.size
    assert apart.max() + 1 <= (plain.max() + 1) * 1.03
    in_order = place_by_rows(lengths, 2048, decreasing_order(lengths, 2048), samples=samples)
    assert in_order.max() > apart.max() + 5


@FAST
@given(problems(max_items=80), st.sampled_from([None, 1, 2, 3, 16]))
def test_histogram_and_per_item_implementations_agree(problem, max_segments):
    lengths, pack_size, _ = problem
    units = np.asarray(lengths, dtype=np.int64)
    assert np.array_equal(bfd_by_cost(units, pack_size, max_segments),
                          place_by_rows(units, pack_size, decreasing_order(units, pack_size), max_segments))
    assert np.array_equal(ffd_by_cost(units, pack_size, max_segments),
                          first_fit(units, pack_size, decreasing_order(units, pack_size), max_segments))
    assert bfd_by_cost(units, pack_size, max_segments).tolist() == ref_bfd(lengths, pack_size, max_segments, [])
    for balanced in (False, True) if max_segments else (False,):
        assert np.array_equal(_fill_by_cost(units, pack_size, max_segments, balanced),
                              _fill_by_item(units, pack_size, max_segments, (), balanced))


@pytest.mark.parametrize("max_segments", [None, 4, 16])
def test_implementations_agree_on_many_repeated_costs(max_segments):
    # thousands of items over few costs: whole cells and repeated pack compositions move as blocks
    rng = np.random.default_rng(1)
    units = rng.integers(1, 40, 5000) * rng.integers(1, 4, 5000)
    assert np.array_equal(bfd_by_cost(units, 256, max_segments),
                          place_by_rows(units, 256, decreasing_order(units, 256), max_segments))
    assert np.array_equal(ffd_by_cost(units, 256, max_segments),
                          first_fit(units, 256, decreasing_order(units, 256), max_segments))
    for balanced in (False, True) if max_segments else (False,):
        assert np.array_equal(_fill_by_cost(units, 256, max_segments, balanced),
                              _fill_by_item(units, 256, max_segments, (), balanced))


@FAST
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.data())
def test_item_that_cannot_fit_names_index_and_cost(lengths, data):
    i = data.draw(st.integers(0, len(lengths) - 1))
    lengths[i] = 101  # longer than the pack
    for j in range(i):
        lengths[j] = min(lengths[j], 100)
    algorithm = data.draw(st.sampled_from(ALGORITHMS))
    with pytest.raises(ValueError, match=rf"item {i} \(cost 101\)"):
        pack_lengths(lengths, 100, algorithm=algorithm)


def test_cannot_fit_after_alignment_or_by_media():
    with pytest.raises(ValueError, match=r"item 1 \(cost 12\).*pack_size 10"):
        pack_lengths([3, 9], 10, align=4)
    with pytest.raises(ValueError, match=r"item 2 \(cost 5\).*images 3 > 2"):
        pack_lengths([5, 5, 5], 100, images=[0, 2, 3], max_images=2)
    with pytest.raises(ValueError, match=r"item 0 \(cost 5\).*image_tokens 700 > 600"):
        pack_lengths([5], 100, image_tokens=[700], max_image_tokens=600)


@pytest.mark.parametrize("bad", [dict(lengths=[3, 0]), dict(algorithm="nope"), dict(max_segments=0),
                                 dict(max_images=2), dict(align=0), dict(lengths=[1.5]), dict(balanced_delta=-1)])
def test_bad_arguments(bad):
    kw = {"lengths": [3, 4], **bad}
    with pytest.raises(ValueError):
        pack_lengths(kw.pop("lengths"), 10, **kw)


def test_empty_input():
    for algorithm in ALGORITHMS:
        out = pack_lengths([], 10, algorithm=algorithm)
        assert out.dtype == np.int64 and out.size == 0


@FAST
@given(st.integers(1, 40), st.integers(1, 3), st.data())
def test_max_tree_searches_match_brute_force(n, dims, data):
    values = st.lists(st.integers(-3, 9) | st.just(NEG), min_size=dims, max_size=dims)
    leaves = [data.draw(values) for _ in range(n)]
    compact = data.draw(st.booleans())
    tree = MaxTree(1, dims, compact) if not compact else MaxTree.from_leaves(
        [np.asarray([leaf[d] for leaf in leaves], dtype=np.int64) for d in range(dims)])
    if not compact:
        tree.grow(n)
        for i, leaf in enumerate(leaves):
            tree.set(i, leaf)
    for _ in range(10):
        if data.draw(st.booleans()):  # an update
            i = data.draw(st.integers(0, n - 1))
            leaves[i] = data.draw(values)
            tree.set(i, leaves[i])
        need = data.draw(st.lists(st.integers(-3, 10), min_size=dims, max_size=dims))
        fits = [i for i, leaf in enumerate(leaves) if all(x >= y for x, y in zip(leaf, need))]
        lo, hi = data.draw(st.integers(0, n + 2)), data.draw(st.integers(-1, n + 2))
        assert tree.leftmost(lo, need) == min([i for i in fits if i >= lo], default=-1)
        assert tree.rightmost(hi, need) == max([i for i in fits if i <= hi], default=-1)


# -- each algorithm's defining behaviour, by hand --------------------------------------------------------------


def test_bfd_takes_the_fullest_pack_ffd_the_first():
    # 5 -> pack 0 (2 left); 3, 3 -> pack 1 (1 left); the 1 goes to the fullest (bfd) or the first (ffd) pack
    assert pack_lengths([5, 3, 3, 1], 7, algorithm="bfd").tolist() == [0, 1, 1, 1]
    assert pack_lengths([5, 3, 3, 1], 7, algorithm="ffd").tolist() == [0, 1, 1, 0]


def test_greedy_fills_one_pack_at_a_time_balanced_spreads():
    lengths = [4, 4, 3, 3, 2, 2]  # total 18 = two packs of 9
    # greedy: {4, 4} (nothing fits the last 1), then {3, 3, 2}, then {2}
    assert pack_lengths(lengths, 9, algorithm="greedy_knapsack").tolist() == [0, 0, 1, 1, 1, 2]
    # balanced: two packs up front, each item to the emptiest -> {4, 3, 2} twice
    assert pack_lengths(lengths, 9, algorithm="balanced_greedy_knapsack").tolist() == [0, 1, 0, 1, 0, 1]
    # one extra pack: 4 | 4 | 3, the second 3 joins the emptiest (6 left), the 2s the two 5s
    assert pack_lengths(lengths, 9, algorithm="balanced_greedy_knapsack",
                        balanced_delta=1).tolist() == [0, 1, 2, 2, 0, 1]


def test_balanced_drops_packs_left_empty():
    assert pack_lengths([9, 1], 10, algorithm="balanced_greedy_knapsack", balanced_delta=3).tolist() == [0, 1]


def test_sequential_keeps_input_order():
    assert pack_lengths([5, 1, 5, 1, 2], 6, algorithm="sequential").tolist() == [0, 0, 1, 1, 2]
    assert pack_lengths([1, 1, 1, 1, 1], 6, algorithm="sequential", max_segments=2).tolist() == [0, 0, 1, 1, 2]
    assert pack_lengths([1, 1, 1], 6, algorithm="sequential", images=[1, 1, 0],
                        max_images=1).tolist() == [0, 1, 1]


def test_first_fit_shuffle_is_seeded():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, 400)
    a = pack_lengths(lengths, 1000, algorithm="first_fit_shuffle", seed=1)
    assert np.array_equal(a, pack_lengths(lengths, 1000, algorithm="first_fit_shuffle", seed=1))
    assert not np.array_equal(a, pack_lengths(lengths, 1000, algorithm="first_fit_shuffle", seed=2))
    # the first pack is filled by first fit over the seeded order
    order = np.random.default_rng(1).permutation(lengths.size)
    assert a[order[0]] == 0


def test_alignment_rounds_costs_up():
    assert pack_lengths([3, 5], 12, align=4).tolist() == [0, 0]  # 4 + 8
    assert pack_lengths([3, 5], 11, align=4).tolist() == [1, 0]  # 4 + 8 > 11; larger cost first


def test_media_caps_move_items():
    # by tokens one pack; images allow 2 per pack
    ids = pack_lengths([4, 3, 2, 1], 10, images=[1, 1, 1, 0], max_images=2)
    assert ids.tolist() == [0, 0, 1, 0]
    ids = pack_lengths([4, 3, 2, 1], 10, image_tokens=[300, 300, 100, 0], max_image_tokens=500)
    assert ids.tolist() == [0, 1, 0, 0]


# -- quality and balance ----------------------------------------------------------------------------------------


def sft_lengths(n, seed=0, pack_size=16384):
    """Lognormal lengths, mean ~1.3k tokens, many short samples: the segment cap binds for plain best fit."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.5, 1.2, n).astype(np.int64) + 1, 1, pack_size)


def fill(ids, lengths, pack_size):
    return lengths.sum() / ((ids.max() + 1) * pack_size)


def test_bfd_fill_under_segment_cap():
    lengths = sft_lengths(50_000)
    ids = pack_lengths(lengths, 16384, max_segments=16)
    assert np.bincount(ids).max() <= 16
    assert fill(ids, lengths, 16384) >= 0.99
    # plain best fit under the same cap (the first candidate) is far worse on this set
    assert fill(bfd_by_cost(lengths, 16384, 16), lengths, 16384) < 0.85
    assert fill(pack_lengths(lengths, 16384), lengths, 16384) >= 0.999


def test_balance_dp_groups():
    lengths = sft_lengths(50_000, seed=3)
    ids = pack_lengths(lengths, 16384, max_segments=16)
    order = balance_dp(ids, lengths, 8)
    n_packs = ids.max() + 1
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(n_packs))
    assert dp_imbalance(ids, lengths, 8, order, reduce="max") <= 1.05
    assert dp_imbalance(ids, lengths, 8, order) < dp_imbalance(ids, lengths, 8)
    assert np.array_equal(order, balance_dp(ids, lengths, 8))


def test_dp_imbalance_by_hand():
    # packs: one 1000-token segment (1000 + 1e6 / 49152) and ten 100-token segments (1000 + 1e5 / 49152)
    ids = np.array([0] + [1] * 10)
    lengths = np.array([1000] + [100] * 10)
    a, b = 1000 + 1e6 / 49152, 1000 + 1e5 / 49152
    assert dp_imbalance(ids, lengths, 2) == pytest.approx(a / ((a + b) / 2))
    assert dp_imbalance(ids, lengths, 1) == 1.0


# -- helpers ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp,tp,sp,want", [(1, 1, False, 1), (2, 1, False, 4), (1, 4, True, 4), (1, 4, False, 1),
                                           (2, 4, True, 8), (3, 2, True, 6), (4, 2, False, 8)])
def test_derive_align(cp, tp, sp, want):
    assert derive_align(cp, tp, sp) == want


def test_l1_bound_and_compare():
    assert l1_bound([4, 4, 3], 5) == 3
    assert l1_bound([], 5) == 0
    lengths = sft_lengths(3000, seed=5, pack_size=4096)
    rows = compare(lengths, 4096, None, max_segments=8, align=2)
    assert [r["algorithm"] for r in rows] == list(ALGORITHMS)
    for r in rows:
        assert set(r) == {"algorithm", "packs", "fill", "l1_bound", "seconds"}
        assert r["packs"] >= r["l1_bound"] == l1_bound(-(-lengths // 2) * 2, 4096)
        assert 0 < r["fill"] <= 1


def test_auto_under_binding_image_cap_is_no_worse_than_either_candidate():
    from packtool.packer.algorithms.bestfit import best_fit_decreasing

    rng = np.random.default_rng(1)
    n = 4000
    images = np.where(rng.random(n) < 0.7, rng.choice([1, 1, 2, 3, 4], n), 0)
    lengths = np.minimum(rng.lognormal(6.0, 0.9, n).astype(np.int64) + 1 + 400 * images, 16384)
    kw = dict(max_segments=16, images=images, max_images=16)
    ids = pack_lengths(lengths, 16384, algorithm="auto", **kw)
    assert_valid(ids, lengths, 16384, **kw)
    shuffled = pack_lengths(lengths, 16384, algorithm="first_fit_shuffle", **kw)
    alone = best_fit_decreasing(lengths.astype(np.int64), 16384, 16, ((images.astype(np.int64), 16),))
    assert np.array_equal(alone, pack_lengths(lengths, 16384, algorithm="bfd", **kw))
    assert ids.max() <= min(shuffled.max(), alone.max())
    assert ids.max() < alone.max()  # on this image-heavy set the shuffled candidate wins


@pytest.mark.parametrize("worst", [False, True])
@pytest.mark.parametrize("max_segments", [None, 3])
def test_rows_bitset_equals_tree(monkeypatch, worst, max_segments):
    """Without extra resources, rows are found through a bitset; the tree gives the same placement."""
    from packtool.packer.algorithms import _rows

    rng = np.random.default_rng(7)
    units = rng.integers(1, 200, size=3000)
    order = np.argsort(-units, kind="stable")
    fast = _rows.place_by_rows(units, 256, order, max_segments, worst=worst, start=5 if worst else 0)
    monkeypatch.setattr(_rows, "_BITSET_ROWS", 0)
    slow = _rows.place_by_rows(units, 256, order, max_segments, worst=worst, start=5 if worst else 0)
    assert np.array_equal(fast, slow)
    assert len(np.unique(fast)) > 1000 // 256


# -- the registry: one list of names, one implementation each ------------------------------------------------
def test_one_list_of_algorithm_names_and_every_name_runs_its_own_implementation(monkeypatch):
    """The settings' type, the CLI's choices and the planner take the names from one registry; each name runs
    the implementation the registry gives it (no name falls through to another algorithm); a name without an
    implementation (or an implementation without a name) is refused when the table is checked."""
    import typing

    import packtool.packer.algorithms.pack as pack_module
    from packtool import settings
    from packtool.packer.algorithms import PLANNERS
    from packtool.packer.algorithms.registry import Algorithm, check_registry

    assert settings.Algorithm is Algorithm and typing.get_args(Algorithm) == ALGORITHMS
    assert list(PLANNERS) == list(ALGORITHMS)
    ran: list[str] = []
    for name in ALGORITHMS:
        def marker(units, cap, max_segments, resources, *, seed, balanced_delta, _name=name):
            ran.append(_name)
            return np.arange(units.size, dtype=np.int64)

        monkeypatch.setitem(pack_module.PLANNERS, name, marker)
        assert pack_lengths([3, 4, 5], 8, algorithm=name).tolist() == [0, 1, 2]
    assert ran == list(ALGORITHMS)
    with pytest.raises(TypeError, match="new_fit without an implementation"):
        check_registry(PLANNERS, (*ALGORITHMS, "new_fit"))
    with pytest.raises(TypeError, match="sequential without a name"):
        check_registry(PLANNERS, tuple(a for a in ALGORITHMS if a != "sequential"))
    with pytest.raises(ValueError, match="unknown algorithm 'new_fit'"):
        pack_lengths([3], 8, algorithm="new_fit")
    with pytest.raises(ConfigError, match="new_fit"):
        settings.PlanSettings(algorithm="new_fit")  # type: ignore[arg-type]
