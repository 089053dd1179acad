"""Progress of loading weights, in bytes: a tqdm bar on a terminal, and (a terminal or not) a log line and a
systemd STATUS= every few seconds with the bytes done and an ETA, so `systemctl status` and the journal show it."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

from shardd.server import systemd

MiB = 1 << 20


class LoadProgress:
    """A `progress(done_bytes, total_bytes)` callback for the weight loaders."""

    def __init__(self, what: str, log: logging.Logger, every_s: float = 2.0) -> None:
        self.what = what
        self.log = log
        self.every_s = every_s
        self.bar: tqdm | None = None
        self.last_report = 0.0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            # disable=None: a bar only on a terminal; under systemd the log lines below say the same.
            self.bar = tqdm(total=total, desc=f"loading {self.what}", unit="B", unit_scale=True, unit_divisor=1024,
                            disable=None, file=sys.stderr, leave=False)
        self.bar.update(done - self.bar.n)
        now = time.monotonic()
        if done < total and now - self.last_report < self.every_s:
            return
        self.last_report = now
        rate = self.bar.format_dict.get("rate") or 0  # bytes/s, tqdm's smoothed estimate
        eta = tqdm.format_interval((total - done) / rate) if rate and done < total else "0:00" if done >= total else "?"
        percent = 100.0 * done / total if total else 100.0
        systemd.notify(f"STATUS=loading weights {done}/{total} bytes ({percent:.0f}%, ETA {eta})")
        self.log.info("loading weights %.1f/%.1f MiB (%.0f%%, ETA %s)", done / MiB, total / MiB, percent, eta)
        if done >= total:
            self.bar.close()
