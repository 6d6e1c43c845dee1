"""When to add or remove an encoder (`--encoders MIN-MAX`): a policy fed with
observations and the time, torch-free, so its tests run in milliseconds on a
synthetic clock.

    observe(now_s, loads, num_starting) -> Decision | None

    up    every encoder's oldest queued image has waited at least
          `scale_up_queue_s`, at every observation for `scale_up_window_s`,
          fewer than `max_encoders` run, none is still starting
    down  more than `min_encoders` run and one has had nothing to do (an empty
          queue, no image answered, stats on time) for `idle_s`: the newest such one goes
    after either, nothing more for `cooldown_s`

The smallest queue age decides: one encoder with a backlog while another
idles is a routing matter, not a lack of encoders. Carrying out a decision
(a process or a Ray actor more, draining one) is epd/processes/encoder_pool.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

from epd.transport.wire.addresses import parse_worker_id

UP, DOWN = "up", "down"
# Encoders report every 0.25 s, but only between batches: stats older than this
# come from an encoder inside a long batch, which is busy whatever they say.
STALE_STATS_S = 1.0


@dataclass(frozen=True)
class EncoderScaling:
    """`--encoders MIN-MAX` and its thresholds; None in ServeConfig means a fixed count."""

    min_encoders: int
    max_encoders: int
    scale_up_queue_s: float = 1.0  # --encoder-scale-up-queue-s: an image waiting this long is a backlog...
    scale_up_window_s: float = 10.0  # --encoder-scale-up-window-s: ...when it lasts this long
    idle_s: float = 60.0  # --encoder-idle-s: an encoder with nothing to do this long is removed
    cooldown_s: float = 30.0  # --encoder-scale-cooldown-s: no decision this soon after the last one

    def __post_init__(self) -> None:
        if not 1 <= self.min_encoders <= self.max_encoders:
            raise ValueError(f"--encoders MIN-MAX needs 1 <= MIN <= MAX, got {self.min_encoders}-{self.max_encoders}")
        for name in ("scale_up_queue_s", "scale_up_window_s", "idle_s", "cooldown_s"):
            if getattr(self, name) < 0:
                flag = {"idle_s": "encoder-idle-s", "cooldown_s": "encoder-scale-cooldown-s"}.get(
                    name, "encoder-" + name.replace("_", "-"))
                raise ValueError(f"--{flag} must not be negative, got {getattr(self, name)}")

    @staticmethod
    def parse_range(value: str) -> tuple[int, int]:
        """'N' -> (N, N); 'MIN-MAX' -> (MIN, MAX); ValueError naming the flag otherwise."""
        low, sep, high = value.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"--encoders takes N or MIN-MAX (e.g. 1-4), got {value!r}")
        return int(low), int(high) if sep else int(low)


@dataclass(frozen=True)
class EncoderLoad:
    """One encoder as the registry last heard of it (its WorkerStats)."""

    worker_id: str
    oldest_queued_s: float  # age of the oldest image in its queue, 0 when empty
    queue_depth: int
    num_answered: int  # images it answered so far (encoded, failed, found cached): grows while it works
    stats_age_s: float = 0.0  # how long ago these stats came


@dataclass(frozen=True)
class Decision:
    direction: str  # UP or DOWN
    worker_id: str | None = None  # DOWN: the encoder to remove


class EncoderAutoscaler:
    def __init__(self, scaling: EncoderScaling):
        self.scaling = scaling
        self._backlog_since_s: float | None = None  # since when every encoder has had a backlog
        self._last_decision_s: float | None = None
        self._busy_s: dict[str, float] = {}  # worker id -> last time it had work
        self._answered: dict[str, int] = {}  # worker id -> num_answered when last seen

    def observe(self, now_s: float, loads: list[EncoderLoad], num_starting: int = 0) -> Decision | None:
        """A decision on the encoders of `loads` (those taking work now) at `now_s`;
        `num_starting` encoders were added and have not registered yet."""
        s = self.scaling
        self._track_idleness(now_s, loads)
        has_backlog = bool(loads) and min(load.oldest_queued_s for load in loads) >= s.scale_up_queue_s
        if not has_backlog:
            self._backlog_since_s = None
        elif self._backlog_since_s is None:
            self._backlog_since_s = now_s
        if self._last_decision_s is not None and now_s - self._last_decision_s < s.cooldown_s:
            return None
        num_encoders = len(loads) + num_starting
        if has_backlog and now_s - self._backlog_since_s >= s.scale_up_window_s and not num_starting \
                and num_encoders < s.max_encoders:
            return self._decided(now_s, Decision(UP))
        if num_encoders > s.min_encoders:
            idle = [load.worker_id for load in loads if now_s - self._busy_s[load.worker_id] >= s.idle_s]
            if idle:
                return self._decided(now_s, Decision(DOWN, max(idle, key=_index)))
        return None

    def _decided(self, now_s: float, decision: Decision) -> Decision:
        self._last_decision_s = now_s
        self._backlog_since_s = None  # the next scale-up needs a whole window of its own
        return decision

    def _track_idleness(self, now_s: float, loads: list[EncoderLoad]) -> None:
        seen = {load.worker_id for load in loads}
        for gone in [w for w in self._busy_s if w not in seen]:
            del self._busy_s[gone], self._answered[gone]
        for load in loads:
            is_busy = load.queue_depth > 0 or load.num_answered != self._answered.get(load.worker_id) \
                or load.stats_age_s > STALE_STATS_S
            if is_busy or load.worker_id not in self._busy_s:  # a new encoder's idle time starts now
                self._busy_s[load.worker_id] = now_s
            self._answered[load.worker_id] = load.num_answered


def _index(worker_id: str) -> int:
    """The k of encoder-k (the newest has the highest); -1 for an id of another form."""
    try:
        return parse_worker_id(worker_id)[1]
    except ValueError:
        return -1
