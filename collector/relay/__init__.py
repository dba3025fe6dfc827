"""The collector's sockets: the ranks' messages in, everything out to subscribers.

- :mod:`~collector.relay.relay`: ranks in on ``XSUB``, everything out on ``XPUB`` (which topics its subscribers
  asked for, and its sockets bound owner-only, in :mod:`~collector.relay.subscriptions`);
- :mod:`~collector.relay.publish_socket`: one publish socket, its topics and its bounds: a job's, and a node collector's
  one endpoint for every job it serves (each message with a frame naming its job);
- :mod:`~collector.relay.intake`: the check of a rank's message on the way in (C twin: ``collector._intake``);
- :mod:`~collector.relay.heartbeats`: what the relay has from every sender, and the heartbeats that say it;
- :mod:`~collector.relay.curve`: CURVE on a TCP publish endpoint, its keys, the ZAP handler that lets in only the
  holders of a client key, and the client side of ``shmstat subscribe --curve``.

The format itself is :mod:`shmstat.wire`. The modules are imported by name.
"""

from __future__ import annotations

__all__: list[str] = []
