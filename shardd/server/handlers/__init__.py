"""One handler per message type, grouped by what they act on. Each takes the decoded request and its `Peer` and
returns `(result, tensors)`, or raises the ProtocolError / ModelError that refuses it; it validates everything
before it changes anything.

- `session.py`: HELLO, OPEN, CLOSE, STATS, SHUTDOWN
- `forward.py`: FORWARD and CAPTURE, of one sequence or a batch, with the head shard's answers
- `rollback.py`: ROLLBACK (one or a batch), SNAPSHOT, RESTORE
- `propose.py`: PROPOSE, and the block a CAPTURE with `propose` drafts in its reply
- ROWS and RING are the relay's (shardd/server/relay.py).
"""
