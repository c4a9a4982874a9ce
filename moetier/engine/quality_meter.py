"""The live quality meter (the confidence gate's, docs/gate.md): how far the gated model's
next-token distributions are from the delta-everywhere model's, on the traffic served.

A sampled fraction of requests (`--quality-meter F`) gets a twin: a second sequence with the
same prompt whose every (token, expert) pair takes the delta plane (the gate's forced rows)
and whose KV is its own (`Request.private_kv`: computed with the delta everywhere, never from
or into the prefix cache). The twin is teacher-forced: the token it appends at each output
index is the one its request sampled there, so at every index both distributions are
conditioned on the same text, the twin's through the full-delta model all the way back, as an
offline comparison of the two models on that text would have them. At each index the meter
adds KL(full-delta || gated) and whether the two top tokens differ, on the device; the sums
come to the host (one copy) when the twin ends. A twin behind its sequence (preempted for KV
pages) catches up after the sequence has ended; an aborted request's twin ends with it.

A step of one position alone, rerun with the delta everywhere, would miss the gated KV of
every earlier position: the twin costs a second sequence's compute and KV for the requests
it meters, and is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TWIN_MARK = "\x1fmeter"  # the twin of sequence s is s + TWIN_MARK


@dataclass
class MeterStats:
    """Totals since start (host numbers; /metrics reads them)."""

    requests: int = 0  # requests metered (twins started)
    positions: int = 0  # output indices compared
    kld_sum: float = 0.0  # sum of KL(full-delta || gated) over them, nats
    disagreements: int = 0  # indices whose two top tokens differ

    @property
    def mean_kld(self) -> float:
        return self.kld_sum / self.positions if self.positions else 0.0

    @property
    def disagreement_rate(self) -> float:
        return self.disagreements / self.positions if self.positions else 0.0


class QualityMeter:
    def __init__(self, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"--quality-meter {fraction}: use a fraction of requests in [0, 1]")
        self.fraction = fraction
        self._seen = 0  # requests offered to `pick`
        self.twin_of: dict[str, str] = {}  # sequence id -> its twin's id
        self.sequence_of: dict[str, str] = {}  # twin id -> its sequence's id
        self._gated: dict[tuple[str, int], torch.Tensor] = {}  # (sequence, index) -> logits
        self._sums: dict[str, list[torch.Tensor]] = {}  # twin id -> [KLD, differs] per index
        self._final: dict[str, list[int]] = {}  # a sequence that ended -> its whole output
        self.stats = MeterStats()

    def pick(self) -> bool:
        """Whether the next request is metered: evenly spaced, so that of the first n
        requests ceil(n * fraction) are (the first request among them)."""
        before = math.ceil(self._seen * self.fraction - 1e-9)
        self._seen += 1
        return math.ceil(self._seen * self.fraction - 1e-9) > before

    def attach(self, sequence_id: str) -> str:
        """Meter `sequence_id`: -> its twin's id (the engine adds the twin's request)."""
        twin = sequence_id + TWIN_MARK
        self.twin_of[sequence_id] = twin
        self.sequence_of[twin] = sequence_id
        self._sums[twin] = []
        self.stats.requests += 1
        return twin

    def is_twin(self, request_id: str) -> bool:
        return request_id in self.sequence_of

    def take(
        self,
        kept: dict[str, torch.Tensor],
        tokens: dict[str, int],
        outputs: dict[str, list[int]],
    ) -> list[str]:
        """After a step: `kept` the raw logits of metered sequences and twins that sampled,
        `tokens` what the step sampled (each twin's entry is replaced here by its sequence's
        token at the twin's index, or removed while the sequence has not sampled that index
        yet: the scheduler then computes the twin's position again), `outputs` the output
        before this step of each running metered sequence and twin. -> twins that are done
        (their sequence's whole text compared): the engine ends them, then calls `end`."""
        for sid, logits in kept.items():
            if sid in self.twin_of:
                self._gated[(sid, len(outputs.get(sid, [])))] = logits
        done = []
        for twin, logits in kept.items():
            of = self.sequence_of.get(twin)
            if of is None:
                continue
            final = self._final.get(of)
            known = final if final is not None else outputs.get(of, [])
            index = len(outputs.get(twin, []))
            token = known[index] if index < len(known) else None
            if token is None and final is None and index == len(known):
                token = tokens.get(of)  # sampled in this very step
            if token is None:
                tokens.pop(twin, None)
                if final is not None:  # nothing more to compare
                    done.append(twin)
                continue  # its sequence is behind (preempted): this position again
            tokens[twin] = token
            gated = self._gated.pop((of, index), None)
            if gated is not None:
                self._sums[twin].append(_compare(logits, gated))
            if final is not None and index + 1 >= len(final):
                done.append(twin)
        return done

    def sequence_ended(self, sequence_id: str, output: list[int], completed: bool) -> str | None:
        """A metered sequence ended with `output`. completed (a stop or the length): its twin
        goes on until it has compared every index (None returned); else (aborted) -> the
        twin's id, which the engine ends now (then `end`)."""
        twin = self.twin_of.get(sequence_id)
        if twin is None:
            return None
        if completed:
            self._final[sequence_id] = list(output)
            return None
        return twin

    def end(self, twin: str) -> None:
        """A twin ended: its sums come to the host (one copy), its state goes."""
        sid = self.sequence_of.pop(twin, None)
        if sid is None:
            return
        self.twin_of.pop(sid, None)
        self._final.pop(sid, None)
        for key in [k for k in self._gated if k[0] == sid]:
            del self._gated[key]
        sums = self._sums.pop(twin, [])
        if sums:
            kld, differs = torch.stack(sums).sum(dim=0).tolist()
            self.stats.positions += len(sums)
            self.stats.kld_sum += kld
            self.stats.disagreements += round(differs)


def _compare(full: torch.Tensor, gated: torch.Tensor) -> torch.Tensor:
    """[V] raw logits of both -> [KL(full || gated), top tokens differ] float64 (device)."""
    log_full = torch.log_softmax(full.double(), dim=-1)
    log_gated = torch.log_softmax(gated.double(), dim=-1)
    kld = (log_full.exp() * (log_full - log_gated)).sum()
    differs = (full.argmax() != gated.argmax()).double()
    return torch.stack([kld, differs])
