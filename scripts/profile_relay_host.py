"""The host cost of a two-daemon step, without sockets and without a device (the relay).

Two `ShardDaemon`s (layers 0:1 and 1:2 of the tiny preset, hidden `--hidden`) over FastShards whose device step is
a no-op, driven in one process the way `coordinator.relay.pipeline.Pipeline` drives them: per step the coordinator
builds each shard's (batched) FORWARD, encodes it (a batch unchecked: its daemon checks each item), the daemon
handles the frames (decode, checks, the step's host work, reply), the coordinator decodes and splits the reply,
and, for a verify, both shards get a ROLLBACK. What is left is every host phase of the relay except the transport
and the device: the figure to compare between commits, here or on a GPU host's CPU.

    PYTHONPATH=$PWD python scripts/profile_relay_host.py --streams 1,8,32
    PYTHONPATH=$PWD python scripts/profile_relay_host.py --streams 32 --rows 1 --profile

Prints per (streams, rows per stream) the host ms per step and its parts, of the fastest of 5 rounds (CPU time of
this one-threaded process); `--json FILE` writes them.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from collections import Counter

import torch

from common.model_config import config_from_dict
from common.presets import PRESETS
from coordinator.relay.client import forward_record
from coordinator.relay.pipeline import head_fields
from protocol import Close, ForwardBatch, Open, Rollback, RollbackBatch, decode_reply, encode_request, split_batch_reply
from protocol.layout import CHECKPOINT
from shardd.config import ShardConfig
from shardd.server.daemon import ShardDaemon
from shardd.engine.fast.shard import FastShard
from shardd.engine.reference import rollback as rb
from shardd.engine.reference.shard import ShardModel
from shardd.synthetic.model import synthetic_weights

BLOCK = 16
ROUNDS = 5  # of --steps steps each; the fastest is reported


def daemons(hidden: int, sequences: int, step_rows: int) -> list[ShardDaemon]:
    config = config_from_dict({**PRESETS["tiny"], "hidden_size": hidden, "num_hidden_layers": 2,
                               "full_attention_interval": 2, "vocab_size": 4096})
    out = []
    for begin, end in ((0, 1), (1, 2)):
        weights = synthetic_weights(config, begin, end, seed=0, dtype=torch.bfloat16, device="cpu")
        model = ShardModel(config, weights, begin, end, dtype=torch.bfloat16, device="cpu",
                           storage=rb.RollbackStorage(CHECKPOINT, BLOCK))
        shard = FastShard(model, max_sequences=sequences, max_context=4096, use_graphs=False, step_rows=step_rows)
        shard.prefill_kernels = False
        shard.runner.run = lambda capture=(): {}  # the device step: a graph replay on the GPU, not host work
        out.append(ShardDaemon(shard, ShardConfig(max_sequences=sequences)))
    return out


class Relay:
    """One coordinator's view of the two daemons: per step, every phase timed into `parts`."""

    def __init__(self, shards: list[ShardDaemon], streams: int, rows: int) -> None:
        self.shards, self.streams, self.rows = shards, streams, rows
        self.pos = [0] * streams
        self.parts: Counter = Counter()
        for shard in shards:
            for seq in range(streams):
                shard.handle(encode_request(Open(id=1, seq=seq)))

    def close(self) -> None:
        for shard in self.shards:
            for seq in range(self.streams):
                shard.handle(encode_request(Close(id=1, seq=seq)))

    def _timed(self, name: str, work, *args):
        started = time.process_time()
        result = work(*args)
        self.parts[name] += time.process_time() - started
        return result

    def step(self) -> None:
        verify = self.rows > 1
        drafts = list(range(1, self.rows)) if verify else None
        answers = None
        for k, shard in enumerate(self.shards):
            head = head_fields(None, drafts) if k == len(self.shards) - 1 else None
            def inputs(seq):
                return {"tokens": list(range(self.rows))} if k == 0 else {"hidden": answers[seq].tensors["hidden"]}

            records = self._timed("coordinator records", lambda: [
                forward_record(seq, self.pos[seq], checkpoint=verify, sampling=head, **inputs(seq))
                for seq in range(self.streams)])
            sent = ForwardBatch(id=2, items=tuple(records)) if self.streams > 1 else records[0]
            frames = self._timed("coordinator encode", encode_request, sent, self.streams == 1)  # as Pipeline sends
            reply = self._timed(f"daemon {k} FORWARD", shard.handle, frames)
            decoded = self._timed("coordinator decode", decode_reply, reply)
            answers = [decoded] if self.streams == 1 else self._timed("coordinator decode", split_batch_reply, decoded,
                                                                      sent)
            if not all(answer.ok for answer in answers):
                raise RuntimeError(f"shard {k} refused an item: {answers[0]}")
        keep = self.rows // 2 or 1
        if verify:
            items = tuple(Rollback(id=0, seq=seq, keep=keep) for seq in range(self.streams))
            rollback = RollbackBatch(id=3, items=items) if self.streams > 1 else items[0]
            for k, shard in enumerate(self.shards):
                frames = self._timed("coordinator encode", encode_request, rollback, self.streams == 1)
                self._timed(f"daemon {k} ROLLBACK", shard.handle, frames)
        for seq in range(self.streams):
            self.pos[seq] += keep if verify else self.rows


def measure(streams: int, rows: int, hidden: int, step_rows: int, steps: int, profile: bool) -> dict:
    relay = Relay(daemons(hidden, streams, max(step_rows, BLOCK)), streams, rows)
    for _ in range(5):
        relay.step()
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    best = None  # (seconds, parts) of the fastest round: a shared host's noise only ever adds time
    # (times are this process's CPU time: one thread, no sockets, so that is all of it, without a VM's steal)
    for _ in range(ROUNDS):
        relay.parts.clear()
        started = time.process_time()
        for _ in range(steps):
            relay.step()
        seconds = time.process_time() - started
        if best is None or seconds < best[0]:
            best = (seconds, dict(relay.parts))
    if profiler:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(40)
    relay.close()
    seconds, parts = best
    return {"streams": streams, "rows": rows, "host_ms_per_step": round(1000 * seconds / steps, 4),
            "parts_ms": {name: round(1000 * value / steps, 4) for name, value in sorted(parts.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--rows", default="1,16", help="rows per stream and step: 1 (greedy), 16 (a verify block)")
    parser.add_argument("--hidden", type=int, default=256, help="small: the host copies of the rows stay out")
    parser.add_argument("--step-rows", type=int, default=128, help="the FastShards' R")
    parser.add_argument("--steps", type=int, default=20, help="steps per round (the fastest of 5 rounds counts)")
    parser.add_argument("--profile", action="store_true", help="cProfile each measured run")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a GPU daemon runs
    results = []
    for streams in (int(s) for s in args.streams.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            if streams * rows > args.step_rows and streams > 1:
                continue  # more rows than one step holds: several steps a call, not what this measures
            result = measure(streams, rows, args.hidden, args.step_rows, args.steps, args.profile)
            results.append(result)
            parts = ", ".join(f"{name} {ms:.3f}" for name, ms in result["parts_ms"].items())
            print(f"streams {streams:3d} rows {rows:3d}: {result['host_ms_per_step']:.3f} ms/step ({parts})",
                  flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"hidden": args.hidden, "step_rows": args.step_rows, "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
