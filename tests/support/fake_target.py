"""An in-memory `Target` with real per-sequence state, for the decoding loops' and the scheduler's tests.

Its "model" reads the last three tokens and the length of its state, so a rollback that keeps one token too many
or too few changes the output; a call the protocol forbids raises `TargetMisuse`.
"""

from collections import Counter

VOCAB = 50


def mixing_rule(state):
    """Next token from the last three tokens and the length: no short cycles."""
    a, b, c = ([0, 0, 0] + state)[-3:]
    x = (a * 7919 + b * 104729 + c * 1299709 + (len(state) // 13) * 15485863) & 0xFFFFFFFF
    x = (x * 2654435761) & 0xFFFFFFFF
    return (x >> 11) % VOCAB


class TargetMisuse(Exception):
    pass


class FakeTarget:
    def __init__(self, rule=mixing_rule):
        self.rule = rule
        self.states: dict[int, list[int]] = {}
        self.pending: dict[int, tuple[int, int]] = {}
        self.snapshots: dict[int, list[int]] = {}
        self.closed_states: dict[int, list[int]] = {}
        self.calls = Counter()
        self.forward_sizes: list[int] = []

    def _state(self, seq):
        if seq not in self.states:
            raise TargetMisuse(f"sequence {seq} is not open")
        return self.states[seq]

    def open(self, seq):
        self.calls["open"] += 1
        if seq in self.states:
            raise TargetMisuse(f"sequence {seq} is already open")
        self.states[seq] = []

    def close(self, seq):
        self.calls["close"] += 1
        self.closed_states[seq] = self._state(seq)
        del self.states[seq]
        self.pending.pop(seq, None)
        self.snapshots.pop(seq, None)

    def forward(self, seq, pos, tokens, *, checkpoint=False):
        self.calls["forward"] += 1
        state = self._state(seq)
        if pos != len(state):
            raise TargetMisuse(f"pos {pos} != length {len(state)}")
        if not tokens or not all(0 <= t < VOCAB for t in tokens):
            raise TargetMisuse(f"bad tokens {tokens}")
        self.pending.pop(seq, None)
        self.forward_sizes.append(len(tokens))
        outputs = []
        for token in tokens:
            state.append(token)
            outputs.append(self.rule(state))
        if checkpoint:
            self.pending[seq] = (pos, len(tokens))
        return outputs

    def rollback(self, seq, keep):
        self.calls["rollback"] += 1
        state = self._state(seq)
        if seq not in self.pending:
            raise TargetMisuse("rollback without a pending step")
        base, n = self.pending.pop(seq)
        if not 0 <= keep <= n:
            raise TargetMisuse(f"keep {keep} outside 0..{n}")
        del state[base + keep:]

    def snapshot(self, seq):
        self.calls["snapshot"] += 1
        self.snapshots[seq] = list(self._state(seq))

    def restore(self, seq):
        self.calls["restore"] += 1
        self._state(seq)
        if seq not in self.snapshots:
            raise TargetMisuse("restore without a snapshot")
        self.pending.pop(seq, None)
        self.states[seq] = list(self.snapshots[seq])
