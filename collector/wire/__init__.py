"""The collector's sockets: the ranks' messages in, everything out to subscribers.

- :mod:`~collector.wire.relay`: ranks in on ``XSUB``, everything out on ``XPUB`` (which topics its subscribers
  asked for, and its sockets bound owner-only, in :mod:`~collector.wire.subscriptions`);
- :mod:`~collector.wire.outlet`: one publish socket, its topics and its bounds: a job's, and a node collector's
  one endpoint for every job it serves (each message with a frame naming its job);
- :mod:`~collector.wire.intake`: the check of a rank's message on the way in (C twin: ``collector._intake``);
- :mod:`~collector.wire.sender_book`: what the relay has from every sender, and the heartbeats that say it;
- :mod:`~collector.wire.curve`: CURVE on a TCP publish endpoint, its keys, the ZAP handler that lets in only the
  holders of a client key, and the client side of ``shmstat subscribe --curve``.

The format itself is :mod:`shmstat.wire`. The modules are imported by name.
"""

from __future__ import annotations

__all__: list[str] = []
