"""What a daemon exposes and to whom: the loopback check, key files, the ipc socket file's mode,
CurveZMQ with logged rejections, and who may send SHUTDOWN (PROTOCOL.md, "Who may do what").

The rule: an `ipc://PATH` socket file is made 0600 after bind, so only the daemon's own user (and
root) can connect at all; over TCP every peer is either Curve-authenticated or a local process of
any user. A sequence belongs to the peer that opened it (shardd.ownership), so another local user
cannot touch it; SHUTDOWN is accepted only where the peer is known to be trusted: over a file
`ipc://` socket, or from an allowed Curve key.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import zmq

log = logging.getLogger("shardd")


def is_file_ipc(endpoint: str) -> bool:
    """An ipc:// endpoint backed by a socket file (not the abstract namespace `ipc://@name`)."""
    return endpoint.startswith("ipc://") and not endpoint[len("ipc://"):].startswith("@")


def restrict_ipc_socket(endpoint: str) -> None:
    """After bind: the socket file 0600, so only this user (and root) can connect."""
    if is_file_ipc(endpoint):
        os.chmod(endpoint[len("ipc://"):], stat.S_IRUSR | stat.S_IWUSR)


def write_private_keys(out_dir: str | Path, name: str) -> tuple[str, str]:
    """`zmq.auth.create_certificates` into a 0700 directory, the secret file 0600 from the start."""
    import zmq.auth

    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    previous = os.umask(0o077)  # the secret file is never readable by others, not even for a moment
    try:
        public, secret = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(previous)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)  # the public half is meant to be shared
    return public, secret


class LoggingAuthenticator:
    """Mixin over pyzmq's authenticator: every refused Curve handshake is logged with peer and reason."""

    def handle_zap_message(self, msg):
        self._peer = (msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?",
                      msg[5].decode("utf-8", "replace") if len(msg) > 5 else "?",
                      zmq.utils.z85.encode(msg[6]).decode() if len(msg) > 6 and len(msg[6]) == 32 else None)
        return super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
        if status_code != b"200":
            address, mechanism, key = getattr(self, "_peer", ("?", "?", None))
            log.warning("refused %s handshake from %s%s: %s", mechanism, address,
                        f" (client key {key})" if key else "", status_text.decode("utf-8", "replace"))
        return super()._send_zap_reply(request_id, status_code, status_text, user_id)


def start_authenticator(context, allow_dir: str):
    from zmq.auth.thread import ThreadAuthenticator

    class Authenticator(LoggingAuthenticator, ThreadAuthenticator):
        pass

    authenticator = Authenticator(context, log=logging.getLogger("shardd.zap"))
    authenticator.start()
    authenticator.configure_curve(domain="*", location=allow_dir)
    return authenticator


REFUSAL_LOG_EVERY_S = 10.0


def log_refused_handshakes(server: zmq.Socket) -> None:
    """Log every handshake a Curve server refuses before ZAP sees it: a client that sent no Curve keys (libzmq's
    mechanism mismatch) is otherwise refused in silence. A thread reads the socket's monitor until it closes."""
    import threading

    from zmq.utils.monitor import recv_monitor_message

    # libzmq reports a mechanism mismatch as a protocol error when this end reads the client's greeting first, and
    # as a handshake failure with no detail (EPIPE, ECONNRESET) when the client saw ours first and hung up: a race
    # between the two ends, so both events are the same refusal.
    monitor = server.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    def watch() -> None:
        logged_at, refused = None, 0  # a client retries every 0.1 s: one line, then one per LOG_EVERY_S with a count
        try:
            while not server.closed:
                if not monitor.poll(200):
                    continue
                event = recv_monitor_message(monitor)
                refused += 1
                now = time.monotonic()
                if logged_at is not None and now - logged_at < REFUSAL_LOG_EVERY_S:
                    continue
                where = event["endpoint"].decode("utf-8", "replace")
                times = f" ({refused} refusals since the last line)" if refused > 1 else ""
                if event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    log.warning("refused a handshake on %s: the client sent no CurveZMQ keys (this daemon requires "
                                "Curve; give shardctl --curve-server-key and --curve-client-key)%s", where, times)
                elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    log.warning("refused a handshake on %s: the client sent no CurveZMQ keys or hung up mid-handshake "
                                "(errno %d; this daemon requires Curve; give shardctl --curve-server-key and "
                                "--curve-client-key)%s", where, event["value"], times)
                else:
                    log.warning("refused a handshake on %s: ZMTP protocol error %#x%s", where, event["value"], times)
                logged_at, refused = now, 0
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            monitor.close(linger=0)

    threading.Thread(target=watch, name="handshake-log", daemon=True).start()
