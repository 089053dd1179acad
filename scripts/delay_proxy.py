#!/usr/bin/env python3
"""A TCP relay on loopback that holds every chunk for a fixed one-way delay: two hosts, simulated.

    python3 scripts/delay_proxy.py --listen 127.0.0.1:7801 --to 127.0.0.1:7701 --delay-ms 0.5

Each accepted connection gets a connection to `--to`; every chunk read from either side is written to the
other `--delay-ms` after it was read, in order (so a stream of chunks keeps its bandwidth and gains the
latency, as a long link does). Threads, not asyncio: asyncio's selector sleeps in whole milliseconds (epoll
rounds its timeout up), which would turn 0.1 ms into 1 ms; a sender thread that sleeps until each chunk's
due time is accurate to ~0.05 ms. Prints "ready" once listening. Bench use only: no limits, loopback only.
"""

from __future__ import annotations

import argparse
import collections
import socket
import sys
import threading
import time


def pump(source: socket.socket, sink: socket.socket, delay_s: float) -> None:
    """Read chunks from `source` and write each to `sink` `delay_s` after it arrived."""
    queue: collections.deque = collections.deque()
    ready = threading.Condition()
    done = [False]

    def sender() -> None:
        while True:
            with ready:
                while not queue and not done[0]:
                    ready.wait()
                if not queue:
                    break
                due, chunk = queue.popleft()
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            try:
                sink.sendall(chunk)
            except OSError:
                break
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    while True:
        try:
            chunk = source.recv(1 << 20)
        except OSError:
            chunk = b""
        with ready:
            if not chunk:
                done[0] = True
            else:
                queue.append((time.perf_counter() + delay_s, chunk))
            ready.notify()
        if not chunk:
            break
    thread.join()


def serve(listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
    server = socket.create_server(listen, reuse_port=False)
    print("ready", flush=True)
    while True:
        client, _ = server.accept()
        try:
            upstream = socket.create_connection(target)
        except OSError:
            client.close()
            continue
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(source, sink, delay_s), daemon=True).start()


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept on (loopback)")
    parser.add_argument("--to", required=True, help="HOST:PORT of the daemon")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every chunk")
    args = parser.parse_args()
    try:
        serve(address(args.listen), address(args.to), args.delay_ms / 1e3)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
