"""The typed protocols the loop relies on: every registered drafter speaks the three verbs (free drafters also offer
candidate chains), and both session classes carry what the engine reads of a session."""
from __future__ import annotations

import typing

import pytest

import edge
from edge.drafters import (DRAFTER_CHOICES, DRAFTER_KINDS, Drafter, FreeDrafter, HybridDrafter, LookupDrafter,
                           NoDrafter, Observer, RecyclingDrafter)
from edge.runner import Session
from memory.footprint import DRAFTERS


def test_the_registry_names_the_memory_models_drafters_and_the_choices_add_auto():
    assert tuple(DRAFTER_KINDS) == DRAFTERS
    assert set(DRAFTER_CHOICES) == {"auto", *DRAFTERS}
    assert [k for k, v in DRAFTER_KINDS.items() if v.needs_topk] == ["recycling", "hybrid"]


def test_free_drafters_offer_chains_and_recycling_observes():
    lookup, rec = LookupDrafter(), RecyclingDrafter(64)
    for name, d in {"lookup": lookup, "recycling": rec, "hybrid": HybridDrafter(lookup, rec)}.items():
        assert DRAFTER_KINDS[name].free and isinstance(d, FreeDrafter), name
    assert isinstance(NoDrafter(), Drafter) and not isinstance(NoDrafter(), FreeDrafter)
    assert isinstance(rec, Observer) and not isinstance(lookup, Observer)
    lookup.begin([1, 2, 3, 1, 2])
    assert [c.tokens.tolist() for c in lookup.chains(4)] == [lookup.draft(4).tokens.tolist()]


def test_the_engines_session_carries_what_the_protocol_names(tiny_dir):
    e = edge.load(tiny_dir, drafter="none", context=64)
    hints = typing.get_type_hints(Session, include_extras=False, localns={"KVCache": object, "Output": object})
    for name in list(hints) + ["call", "forward", "prefill"]:
        assert hasattr(e.target, name), name
    out = e.target.call([5, 6, 7])
    assert out.logits.shape == (3, e.target.vocab) and e.target.cache.length == 0  # nothing committed by a call


@pytest.mark.parametrize("kind", ["lookup", "recycling", "hybrid", "none"])
def test_the_engine_runs_each_registered_drafter(tiny_dir, kind):
    e = edge.load(tiny_dir, drafter=kind, context=128)
    r = e.generate("hello there hello there", max_tokens=6)
    assert r.stats.drafter == kind and len(r.token_ids) >= 1
