"""Admission decisions: block counts for a token plan, and the policy chain under pressure.

Everything here is a pure function of its arguments and returns a decision as data;
the store and the server carry decisions out and report back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from kvstore.errors import CapacityError, ConfigError, MalformedError

# The most times a block counts being committed or hit, for the SSD tier's admission
# filter (``ssd.admit_after`` asks at most this many): the count lives in a few bits of
# the block's ``marks``, which stays a small int Python keeps for every block.
SEEN_MOST = 7

# -- batch reservation for a token plan ----------------------------------------


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """One request of a token plan: ``reserved`` tokens held already, ``new`` to add."""

    reserved: int
    new: int


def blocks_needed(reserved: int, new: int, block_tokens: int) -> int:
    """``dq = ceil((T + s) / B) - ceil(T / B)``: blocks that ``new`` more tokens take."""
    if block_tokens <= 0:
        raise MalformedError(f"block_tokens must be positive, got {block_tokens}")
    if reserved < 0 or new < 0:
        raise MalformedError(f"token counts must be >= 0, got reserved={reserved} new={new}")
    return -(-(reserved + new) // block_tokens) - -(-reserved // block_tokens)


@dataclass(frozen=True, slots=True)
class BatchDecision:
    """The answer for a token plan.

    ``admitted`` is all-or-none: the plan's slots (``total``: its ``blocks`` less those
    cached already) fit in ``available``.  When they do not, ``fitting`` names the
    requests (by index) that a greedy pass in order would admit, and ``shortfall`` is
    how many blocks the whole plan lacks.
    """

    admitted: bool
    blocks: tuple[int, ...]
    total: int
    available: int
    fitting: tuple[int, ...]

    @property
    def shortfall(self) -> int:
        return max(0, self.total - self.available)


def admit_batch(
    requests: Sequence[TokenRequest],
    block_tokens: int,
    available: int,
    *,
    stop_at_first_misfit: bool = False,
    held: Sequence[int] = (),
) -> BatchDecision:
    """Decide a token plan against ``available`` free blocks, all or none.

    The greedy report takes each request in order while it fits and skips one that
    does not (later, smaller ones may still fit); with ``stop_at_first_misfit`` it
    stops there instead, for schedulers that must not reorder.  ``held[i]`` of request
    i's blocks are cached already and take no slot (``blocks`` still counts them).
    """
    if available < 0:
        raise MalformedError(f"available must be >= 0, got {available}")
    blocks = tuple(blocks_needed(r.reserved, r.new, block_tokens) for r in requests)
    if held and (len(held) != len(blocks) or any(not 0 <= h <= b for h, b in zip(held, blocks))):
        raise MalformedError(f"held blocks {list(held)} do not fit the requests' {blocks}")
    slots = tuple(b - h for b, h in zip(blocks, held)) if held else blocks
    total = sum(slots)
    if total <= available:
        return BatchDecision(True, blocks, total, available, tuple(range(len(blocks))))
    fitting: list[int] = []
    left = available
    for index, count in enumerate(slots):
        if count <= left:
            fitting.append(index)
            left -= count
        elif stop_at_first_misfit:
            break
    return BatchDecision(False, blocks, total, available, tuple(fitting))


# -- the policy chain under pressure -------------------------------------------

Step = Literal["evict", "demote", "defer", "reject"]
STEPS: tuple[Step, ...] = get_args(Step)
DEFAULT_CHAIN: tuple[Step, ...] = ("evict", "demote", "defer", "reject")
_ROOM_STEPS = ("evict", "demote")  # the steps that free slots (the others wait or refuse)


@dataclass(frozen=True, slots=True)
class Shortfall:
    """The facts a pressure decision needs, in slots of one slab class of one tier.

    The unpinned blocks split in two: ``evictable`` ones may be dropped now at no loss
    (a copy lives in a lower tier, or the configuration drops cold blocks), and
    ``demotable`` ones must be copied down first; ``next_tier_room`` caps how many of
    those the next tier takes (0 for the last tier).  ``defer_until`` is the latest time
    the request may wait, or None if it may not.  ``capacity``, when given, lets a
    request larger than the whole class fail at once instead of waiting in vain.
    """

    need: int
    free: int
    evictable: int
    demotable: int = 0
    next_tier_room: int = 0
    now: float = 0.0
    defer_until: float | None = None
    capacity: int | None = None

    def __post_init__(self) -> None:
        counts = (self.need, self.free, self.evictable, self.demotable, self.next_tier_room)
        if min(counts) < 0:
            raise MalformedError(f"slot counts must be >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do about a request, as data.

    Admitted (``reject`` and ``defer_until`` both None): first evict ``evict`` blocks
    and demote ``demote`` blocks to the next tier, then reserve.  Deferred: wait until
    ``defer_until`` (or until room appears) and run the chain again.  Rejected:
    ``reject`` says why, in words for the client.  A plan that does not admit never
    evicts or demotes: freeing slots for a request that may not come is a loss.
    """

    evict: int = 0
    demote: int = 0
    defer_until: float | None = None
    reject: str | None = None

    @property
    def admitted(self) -> bool:
        return self.reject is None and self.defer_until is None

    def error(self) -> CapacityError:
        """The typed error a rejected plan becomes."""
        assert self.reject is not None, "only a rejected plan has an error"
        return CapacityError(self.reject)


@dataclass(frozen=True, slots=True)
class PolicyChain:
    """The configured steps under pressure, tried in order.

    Steps: ``evict`` (drop unpinned blocks that can go at no loss), ``demote`` (copy
    other unpinned blocks to the next tier, then free them), ``defer`` (wait, if the
    request allows it), ``reject``.  Each step is used
    at most once and nothing may follow ``reject``; whatever chain is configured, a
    request that its steps cannot place ends rejected with the cause.
    """

    steps: tuple[Step, ...] = DEFAULT_CHAIN
    _passes: dict[bool, tuple[tuple[Step, ...], ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError("policy chain: at least one step is needed")
        for step in self.steps:
            if step not in STEPS:
                raise ConfigError(f"policy chain: unknown step {step!r}; expected {STEPS}")
        if len(set(self.steps)) != len(self.steps):
            raise ConfigError(f"policy chain: a step appears twice in {self.steps}")
        if "reject" in self.steps[:-1]:
            raise ConfigError("policy chain: 'reject' ends the chain; nothing may follow it")
        for may_defer in (False, True):
            self._passes[may_defer] = self._room_passes(may_defer)

    def room_passes(self, may_defer: bool) -> tuple[tuple[Step, ...], ...]:
        """The steps that make room now, in the chain's order, as passes over the
        eviction order: while a request may still defer, the steps before "defer";
        after (or for a request that may not defer), all of them.  ``evict`` and
        ``demote`` side by side are one pass, taking the coldest block first whichever
        of the two it needs (all of one kind first would give up hot blocks for cold
        ones); apart, or alone, each is a pass of its own."""
        return self._passes[may_defer]

    def _room_passes(self, may_defer: bool) -> tuple[tuple[Step, ...], ...]:
        steps = self.steps
        if may_defer and "defer" in steps:
            steps = steps[:steps.index("defer")]
        passes: list[tuple[Step, ...]] = []
        prev: Step | None = None
        for step in steps:
            if step in _ROOM_STEPS:
                if passes and prev in _ROOM_STEPS:
                    passes[-1] = (*passes[-1], step)
                else:
                    passes.append((step,))
            prev = step
        return tuple(passes)

    def plan(self, s: Shortfall) -> Plan:
        """Walk the steps until the request is placed, deferred or rejected."""
        missing = s.need - s.free
        if missing <= 0:
            return Plan()
        if s.capacity is not None and s.need > s.capacity:
            return Plan(reject=f"{s.need} slots requested; the class holds {s.capacity} in all")
        evict = demote = 0
        tried: list[str] = []
        for step in self.steps:
            if step == "evict":
                evict = min(missing, s.evictable)
                missing -= evict
                tried.append(f"{s.evictable} evictable")
            elif step == "demote":
                demote = min(missing, s.demotable, s.next_tier_room)
                missing -= demote
                tried.append(f"{s.demotable} demotable with room for {s.next_tier_room} below")
            elif step == "defer":
                if s.defer_until is not None and s.defer_until > s.now:
                    return Plan(defer_until=s.defer_until)
                tried.append("no deferral allowed")
            else:
                break
            if missing <= 0:
                return Plan(evict=evict, demote=demote)
        return Plan(
            reject=(
                f"{s.need} slots requested, {s.free} free; "
                f"{', '.join(tried) or 'no pressure step configured'}; "
                f"{missing} short. Release pins, retry later or raise the capacity"
            )
        )
