"""A model of the push all-reduce's protocol (models/push_all_reduce.py) between two ranks, to ask
which end states a stall can have: each rank's calls push one word per lane, tagged with the
call's count, into the peer's slot of the count's parity, and wait for the peer's word of the same
count in its own slot of that parity. The model keeps, per rank, the last tag in each of its two
slots (a program's lanes move together), and searches every interleaving.

    python scripts/push_protocol_model.py --calls 45 --stall 38,36,39 38,37,38

asks whether rank 0 can end waiting for call 38 with its slot of that call's parity holding 36 and
its other slot 39, while rank 1 waits for 38 with 37 and 38 (docs/PARALLEL.md, "Push all-reduce",
Open; about 45 s), under each variant: in step; a count skipped or repeated once; a rank's count
jumping to any value once (one rank or both); up to four calls of a rank in flight at once. Prints each variant
and whether the stall is reachable; exits 0 if none reaches it. Then (`fits`) it lets one rank's
two calls up to the stall do anything a kernel could get wrong: push any tag into either slot or
nowhere, and wait for any tag in either slot, and prints the alterations that reach the stall,
fewest changes first: what to look for in the counters and slots of the next stall."""

from __future__ import annotations

import argparse
import itertools
from typing import Iterator, Sequence

Call = tuple[int, "int | None", int, int]
"""One call of a rank: (tag pushed, slot pushed to or None: lost, tag waited for, slot polled). As
the protocol makes call k: (k, k % 2, k, k % 2)."""
End = tuple[int, int, int]
"""A stalled rank: (the tag it waits for, the tag in the slot it polls (its call's parity, as the
protocol makes it), in the other slot)."""


def counted(calls: int, jump_at: int | None = None, to: int = 0) -> list[Call]:
    """A rank's calls 1..`calls`: tag and parity from the count (`tag_of_call`); from call `jump_at`
    on, the count continues from `to` (its counter altered once)."""
    out = []
    for k in range(1, calls + 1):
        count = k if jump_at is None or k < jump_at else to + (k - jump_at)
        out.append((count, count % 2, count, count % 2))
    return out


def end_states(sequences: Sequence[Sequence[Call]], in_flight: int = 1,
               slots: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))) -> set[tuple[End | None, ...]]:
    """Every state where neither rank can move, over all interleavings. A rank may push up to
    `in_flight` calls beyond the oldest it has not finished (1: a call pushes only after the one
    before it ended), and finishes its calls in order when its slot holds the call's tag. A rank
    that finished every call ends as None. `slots`: each rank's two slots before the first call
    (zeroed buffers, or where earlier calls left them)."""
    start = ((0, 0), (0, 0), slots)
    seen, stack, ends = set(), [start], set()
    while stack:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        progress, slots = [state[0], state[1]], state[2]
        moves = []
        for rank in (0, 1):
            pushed, done = progress[rank]
            calls = sequences[rank]
            if pushed < len(calls) and pushed - done < in_flight:
                tag, slot, _, _ = calls[pushed]
                peer = [list(s) for s in slots]
                if slot is not None:
                    peer[1 - rank][slot] = tag
                nxt = list(progress)
                nxt[rank] = (pushed + 1, done)
                moves.append((nxt[0], nxt[1], (tuple(peer[0]), tuple(peer[1]))))
            if done < pushed:
                _, _, wanted, polled = calls[done]
                if slots[rank][polled] == wanted:
                    nxt = list(progress)
                    nxt[rank] = (pushed, done + 1)
                    moves.append((nxt[0], nxt[1], slots))
        if not moves:
            ends.add(_ends(sequences, [done for _, done in progress], slots))
        stack.extend(moves)
    return ends


def variants(calls: int, around: range) -> Iterator[tuple[str, list[list[Call]], int]]:
    """(name, both ranks' calls, calls in flight) of each variant the module docstring lists;
    `around`: the calls where a count may go wrong."""
    normal = counted(calls)
    yield "in step", [normal, normal], 1
    for rank, at, by in itertools.product((0, 1), around, (-1, 1)):
        altered = counted(calls, at, at + by)
        yield f"rank {rank}'s count {'repeated' if by < 0 else 'skipped'} at call {at}", \
            [altered, normal] if rank == 0 else [normal, altered], 1
    jumps = [None] + [(at, to) for at in around for to in around]
    for jump0, jump1 in itertools.product(jumps, repeat=2):
        if jump0 is None and jump1 is None:
            continue
        seq = [counted(calls, *j) if j is not None else normal for j in (jump0, jump1)]
        yield f"counts jumping once: rank 0 {jump0}, rank 1 {jump1}", seq, 1
    for depth in (2, 3, 4):
        yield f"up to {depth} calls of a rank in flight", [normal, normal], depth


def _ends(sequences: Sequence[Sequence[Call]], done: Sequence[int], slots) -> tuple[End | None, ...]:
    """Each rank's end: None when it made every call, else (the tag its next call waits for, the
    tag in the slot it polls, in the other slot)."""
    ends = []
    for rank in (0, 1):
        if done[rank] >= len(sequences[rank]):
            ends.append(None)
            continue
        _, _, wanted, polled = sequences[rank][done[rank]]
        ends.append((wanted, slots[rank][polled], slots[rank][1 - polled]))
    return tuple(ends)


def fits(stall: tuple[End, End], tags: range) -> list[tuple[int, int, Call, Call]]:
    """(changes, rank, the call before the stalled one, the stalled one) for every alteration of one
    rank's two calls up to the stall (any `Call`, tags from `tags`) that ends in `stall` in some
    interleaving, the other rank and every other call as the protocol makes them; fewest changed
    fields first. Searched from where both ranks ended call `waited` - 4, through call `waited`:
    the calls before were the protocol's (its two slots keep them apart), and a rank stalled at
    `waited` pushes nothing later."""
    waited = stall[0][0]
    window = [(k, k % 2, k, k % 2) for k in range(waited - 3, waited + 1)]
    last = waited - 4    # both ranks' slots hold it and the call before, each in its parity's slot
    slots = (last, last - 1) if last % 2 == 0 else (last - 1, last)
    options = [(tag, slot, wanted, polled) for tag in tags for slot in (0, 1, None) for wanted in tags
               for polled in (0, 1)]
    found = []
    for rank in (0, 1):
        for before, at in itertools.product(options, repeat=2):
            altered = [*window[:2], before, at]
            if stall in end_states([altered, window] if rank == 0 else [window, altered], slots=(slots, slots)):
                changes = sum(a != b for a, b in zip(before + at, window[2] + window[3]))
                found.append((changes, rank, before, at))
    return sorted(found, key=lambda fit: (fit[0], fit[1], str(fit[2:])))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=45, help="calls each rank makes")
    parser.add_argument("--stall", nargs=2, required=True, metavar="WAITED,THIS,OTHER",
                        help="each rank's end: the tag it waits for, the tags in its two slots")
    parser.add_argument("--around", type=int, nargs=2, default=(30, 45), metavar=("FIRST", "LAST"),
                        help="the calls where a count may go wrong (default 30 45)")
    args = parser.parse_args(argv)
    stall = tuple(tuple(int(x) for x in end.split(",")) for end in args.stall)
    reached = []
    for name, sequences, depth in variants(args.calls, range(args.around[0], args.around[1] + 1)):
        if stall in end_states(sequences, depth):
            reached.append(name)
            print(f"reachable: {name}")
    print(f"the stall {args.stall[0]} / {args.stall[1]} is reachable in {len(reached)} variant(s)")
    waited = stall[0][0]
    found = fits(stall, range(max(1, waited - 3), waited + 3))
    print(f"{len(found)} alteration(s) of one rank's calls {waited - 1} and {waited} reach it "
          "((tag pushed, slot pushed to or None: lost, tag waited for, slot polled) of each):")
    for changes, rank, before, at in found[:10]:
        print(f"  {changes} field(s) changed: rank {rank}, call {waited - 1} {before}, call {waited} {at}")
    return 1 if reached else 0


if __name__ == "__main__":
    raise SystemExit(main())
