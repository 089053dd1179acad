"""The shard daemon's server: what runs requests over an engine.

- `daemon.py`: `ShardDaemon`, the handler table and the one place a request becomes its reply (or its refusal).
- `loop.py`: the serving loop (the socket, polling, signals, systemd); `listen.py`, `receive.py`, `security.py`,
  `systemd.py`: binding, reading a request frame by frame, keys and permissions, sd_notify.
- `handlers/`: one handler per message type; `sequences.py`: the sequence table (ownership, lease, failure);
  `peer.py`: who sent a request; `stats.py`: the counters; `errors.py`: refusals and their codes.
- `relay.py`, `rows.py`, `ring.py`: rows from shard to shard, through the host or a device ring.
"""
