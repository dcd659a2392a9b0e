"""Peers' signs of life (`kvd.core.silence`)."""

from __future__ import annotations

from kvd.core.silence import LastSigns


def test_the_last_sign_is_the_latest_of_a_note_and_when_the_peer_was_learned() -> None:
    signs = LastSigns()
    assert signs.last("p", 5.0) == 5.0  # never heard: since we learned of it
    signs.note("p", 7.0)
    assert signs.last("p", 5.0) == 7.0
    assert signs.last("p", 9.0) == 9.0  # handshaked again after its last note
    signs.note("p", 8.0)
    assert signs.last("p", 0.0) == 8.0  # the latest note counts


def test_retain_keeps_only_the_known_agents() -> None:
    signs = LastSigns()
    for i, agent in enumerate(("a", "b", "rogue")):
        signs.note(agent, float(i))
    signs.retain({"a", "b"})
    assert len(signs) == 2
    assert signs.last("rogue", -1.0) == -1.0 and signs.last("b", 0.0) == 1.0
