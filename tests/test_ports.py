"""The rendezvous ports the multi-rank tests use: never one the kernel may hand to an outgoing connection.

CI once failed with EADDRINUSE: a port picked with ``bind(("127.0.0.1", 0))`` is from the ephemeral range, which
every gloo connection of a parallel worker draws from too, so it could be taken before its command listened.
"""

from __future__ import annotations

import socket

from tests.dist_utils import _ephemeral_range, free_port


def test_ports_are_free_and_outside_the_ephemeral_range() -> None:
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert all(not (low <= p <= high) for p in ports), ports
    assert len(set(ports)) > 40  # drawn at random, not one fixed port two workers would share
    for p in ports[:5]:
        with socket.socket() as s:  # free: a listener can bind it now
            s.bind(("127.0.0.1", p))


def test_a_port_being_listened_on_is_not_drawn(monkeypatch) -> None:
    taken, other = free_port(), free_port()
    while other == taken:
        other = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", taken))
        busy.listen()
        start = 20000 if _ephemeral_range()[0] > 21000 else 1024
        draws = iter([taken - start] * 4 + [other - start])

        class Drawn:  # the first four draws land on the busy port, the fifth on a free one
            def randrange(self, span: int) -> int:
                return next(draws)

        monkeypatch.setattr("tests.dist_utils.random.Random", Drawn)
        assert free_port() == other
