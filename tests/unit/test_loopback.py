"""The suite's own guard (tests/support/loopback.py, installed by conftest.py here and by tests/support/site in
every Python process a test starts): a connection or a name lookup that would leave loopback fails at once with an
error naming it, loopback itself still works, and the Hugging Face libraries are offline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.support.loopback import OFFLINE


@pytest.mark.parametrize("address", [("10.255.255.1", 80), ("192.0.2.1", 443), ("0.0.0.0", 9)])
def test_a_connection_off_loopback_fails_at_once_naming_the_address(address):
    started = time.monotonic()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(ConnectionRefusedError) as refused:
        sock.connect(address)
    assert time.monotonic() - started < 1 and f"{address[0]}:{address[1]}" in str(refused.value)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(ConnectionRefusedError):
        sock.connect_ex(address)


@pytest.mark.parametrize("name", ["s3.amazonaws.com", "huggingface.co", b"example.com"])
def test_a_name_lookup_off_loopback_fails_at_once(name):
    with pytest.raises(socket.gaierror, match="refused to look up"):
        socket.getaddrinfo(name, 443)
    with pytest.raises(socket.gaierror, match="refused to look up"):
        socket.gethostbyname(name)


def test_loopback_still_connects():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for host in ("127.0.0.1", "localhost"):
            with socket.create_connection((host, port), timeout=5):
                pass


def test_the_hugging_face_libraries_are_offline_here_and_in_started_processes():
    assert all(os.environ[name] == "1" for name in OFFLINE)
    seen = subprocess.run([sys.executable, "-c", f"import os; print([os.environ.get(n) for n in {OFFLINE!r}])"],
                          capture_output=True, text=True, check=True).stdout
    assert seen.strip() == repr(["1"] * len(OFFLINE))


def test_a_started_python_process_is_guarded_too():
    code = ("import socket\n"
            "try:\n    socket.getaddrinfo('127.evil.example', 80)\nexcept socket.gaierror as e:\n    print(e)\n"
            "s = socket.socket()\n"
            "try:\n    s.connect(('192.0.2.1', 80))\nexcept OSError as e:\n    print(e)\n")
    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30).stdout
    assert "refused to look up '127.evil.example'" in seen and "refused to connect to 192.0.2.1:80" in seen
