"""The daemon's log: one line per event on stderr (journald adds the time and pid itself, but a terminal or a
file does not), as text or as one JSON object per line (`--log-format json`) for log shippers."""

from __future__ import annotations

import json
import logging
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup(level: str = "INFO", fmt: str = "text") -> logging.Logger:
    """Our own logger only: torch's loggers stay at their defaults instead of chattering at INFO."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s shardd[%(process)d] %(levelname)s %(message)s"))
    log = logging.getLogger("shardd")
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False
    return log
