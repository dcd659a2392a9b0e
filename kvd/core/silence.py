"""Signs of life of peer daemons: when each last spoke to us.

The notifier notes every authentic notification of a peer, the registrar every answer of
its side channel and every handshake; the registrar forgets a peer whose last sign is
older than `side_channel.forget_silent_peers` (`kvd.actors.registrar`). One object, owned
by the daemon and shared by the two actors on its event loop (as the sender's pending
budget is shared with the notifier). Sans-IO: `now` is a parameter.
"""

from __future__ import annotations

from collections.abc import Collection


class LastSigns:
    """Agent -> when (daemon time) it last gave a sign of life."""

    __slots__ = ("_at",)

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._at)

    def note(self, agent: str, now: float) -> None:
        """`agent` spoke to us at `now`."""
        self._at[agent] = now

    def last(self, agent: str, default: float) -> float:
        """When `agent` last spoke to us, or `default` (when we learned of it) if later."""
        return max(self._at.get(agent, default), default)

    def retain(self, agents: Collection[str]) -> None:
        """Keep only these agents (the peers known: any agent's notification is noted
        before anyone judges it, so the others would pile up)."""
        for agent in [a for a in self._at if a not in agents]:
            del self._at[agent]
