"""Host time of the wire codec on the verify step's hot path, in microseconds per call (no GPU, no sockets):
the coordinator's with_id and encode of each request, the daemon's decode of it, and the reply both ways."""

import secrets
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.relay.client import forward_record  # noqa: E402
from protocol import MessageType, Rollback, decode_reply, decode_request, encode_reply, encode_request  # noqa: E402
from protocol.codec import with_id  # noqa: E402


def us(fn, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main(n: int = 2000) -> None:
    ticket = secrets.randbits(62)
    cases = {
        "FORWARD tokens": forward_record(1, 100, checkpoint=True, layers=None, sampling=None, tokens=list(range(16)),
                                         send_rows=ticket),
        "FORWARD rows_ticket": forward_record(1, 100, checkpoint=True, rows_ticket=ticket, ticket_rows=16),
        "ROLLBACK": Rollback(id=7, seq=1, keep=5),
    }
    for name, record in cases.items():
        frames = encode_request(record)
        print(f"{name:22s} with_id {us(lambda: with_id(record, 12345), n):6.2f}  "
              f"encode {us(lambda: encode_request(record), n):6.2f}  decode {us(lambda: decode_request(frames), n):6.2f}")
    result = {"seq": 1, "length": 116, "ids": list(range(1000, 1016)), "pos": 116}
    frames = encode_reply(12345, MessageType.FORWARD, result, {})
    print(f"{'FORWARD reply':22s} {'':14s}  encode {us(lambda: encode_reply(12345, MessageType.FORWARD, result, {}), n):6.2f}  "
          f"decode {us(lambda: decode_reply(frames), n):6.2f}")


if __name__ == "__main__":
    main()
