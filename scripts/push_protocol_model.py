"""A model of the push all-reduce's protocol (models/push_all_reduce.py) between two ranks, to ask
which end states a stall can have: each rank's calls push one word per lane, tagged with the
call's count, into the peer's slot of the count's parity, and wait for the peer's word of the same
count in its own slot of that parity. The model keeps, per rank, the last tag in each of its two
slots (a program's lanes moving together, except in `split_lanes_ends`), and searches every
interleaving.

    python scripts/push_protocol_model.py --calls 45 --stall 38,36,39 38,37,38

asks whether rank 0 can end waiting for call 38 with its slot of that call's parity holding 36 and
its other slot 39, while rank 1 waits for 38 with 37 and 38 (the timeout records of a stall,
docs/PARALLEL.md, "Push all-reduce"; about 50 s), under each variant: in step; a count skipped or
repeated once; a rank's count jumping to any value once (one rank or both); a counter's upper half
altered (the count plus m x 2^32 from some call on, one rank or both: the tag wraps modulo
2^32 - 1 while the slot follows the count's parity, so tags land in the other parity's slot), or
the count plus 2^32 - 1 (the same tags, each in the other parity's slot); up to four calls of a
rank in flight at once. Then (`overlapping_records`) it lets a rank's kernels overlap, as they
would if the PDL chain between them broke: a kernel may start once the one before it has started,
and its read and write of the call counter are separate steps, so two kernels may read the same
count; a stalled rank's timeout record may mix the fields of its stalled kernels (each writes its
row field by field). Then (`split_lanes_ends`) it splits one call's lanes: the warps that read the
count after thread 0 stored it take the next count (the kernel's race while every thread read the
count: the records above are exactly rank 1's call 38 split so). Prints whether each reaches the
stall, and exits 0 if none does. Last (`fits`) it lets one rank's two calls up to the stall do
anything a kernel could get wrong (push any tag into either slot or nowhere, wait for any tag in
either slot) and prints the alterations that reach the stall, fewest changes first."""

from __future__ import annotations

import argparse
import itertools
from typing import Any, Callable, Iterator, Sequence

Call = tuple[int, "int | None", int, int]
"""One call of a rank: (tag pushed, slot pushed to or None: lost, tag waited for, slot polled). As
the protocol makes call k: (k, k % 2, k, k % 2)."""
End = tuple[int, int, int]
"""A stalled rank: (the tag it waits for, the tag in the slot it polls (its call's parity, as the
protocol makes it), in the other slot)."""


def tag_of(count: int) -> int:
    """The tag of a call's words: models/push_all_reduce.tag_of_call's, 32 bits that are never 0
    (the count itself below 2^32 - 1)."""
    return (count - 1) % 0xFFFFFFFF + 1


def counted(calls: int, jump_at: int | None = None, to: int = 0) -> list[Call]:
    """A rank's calls 1..`calls`: tag and parity from the count (`tag_of_call`); from call `jump_at`
    on, the count continues from `to` (its counter altered once)."""
    out = []
    for k in range(1, calls + 1):
        count = k if jump_at is None or k < jump_at else to + (k - jump_at)
        out.append((tag_of(count), count % 2, tag_of(count), count % 2))
    return out


def stuck_ends(start, moves_of: Callable[[Any], list], end_of: Callable[[Any], Any]) -> set:
    """`end_of(state)` of every state reachable from `start` (over all interleavings: `moves_of`
    gives a state's successors) from which no move is left."""
    seen, stack, ends = set(), [start], set()
    while stack:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        moves = moves_of(state)
        if not moves:
            ends.add(end_of(state))
        stack.extend(moves)
    return ends


def in_step_slots(last: int) -> tuple[int, int]:
    """A rank's two slots once both ranks ended call `last` in step: it and the call before, each in
    its parity's slot."""
    return (last, last - 1) if last % 2 == 0 else (last - 1, last)


def end_states(sequences: Sequence[Sequence[Call]], in_flight: int = 1,
               slots: tuple[tuple[int, int], tuple[int, int]] = ((0, 0), (0, 0))) -> set[tuple[End | None, ...]]:
    """Every state where neither rank can move, over all interleavings. A rank may push up to
    `in_flight` calls beyond the oldest it has not finished (1: a call pushes only after the one
    before it ended), and finishes its calls in order when its slot holds the call's tag. A rank
    that finished every call ends as None. `slots`: each rank's two slots before the first call
    (zeroed buffers, or where earlier calls left them)."""
    def moves_of(state) -> list:
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
        return moves

    return stuck_ends(((0, 0), (0, 0), slots), moves_of,
                      lambda state: _ends(sequences, [state[0][1], state[1][1]], state[2]))


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
    shifts = {1 << 32: "upper half plus 1", 2 << 32: "upper half plus 2",
              0xFFFFFFFF: "plus 2^32 - 1 (the same tag in the other slot)"}
    for at, shift, ranks in itertools.product(around, shifts, ((0,), (1,), (0, 1))):
        altered = counted(calls, at, at + shift)
        seq = [altered if rank in ranks else normal for rank in (0, 1)]
        yield f"counter's {shifts[shift]} from call {at} on rank(s) {ranks}", seq, 1
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


def overlapping_records(first: int, kernels: int) -> set[tuple[frozenset, frozenset]]:
    """Every stalled end of `kernels` kernels per rank, calls `first`.. on, when a rank's kernel may
    start once the one before it has started (not ended): each kernel reads the call counter, writes
    it back plus one, pushes its words (tag and slot from the count it read) and polls, as separate
    steps, so two kernels may read the same count. Both ranks start with their counters at
    `first` - 1 and their slots holding calls `first` - 1 and `first` - 2, as in step. Returns, per
    end with a rank stalled, each rank's possible timeout records (End): one field from each of
    its stalled kernels, in any combination (each kernel writes the row of its program field by
    field, so two that time out together mix)."""
    last = first - 1
    idle = (0,) * kernels   # per kernel: 0 not started, 1 read the counter, 2 wrote it, 3 pushed, 4 done
    slots = in_step_slots(last)

    def moves_of(state) -> list:
        moves = []
        for rank in (0, 1):
            counter, phases, read = state[rank]
            for k, phase in enumerate(phases):
                if phase == 4 or (phase == 0 and k > 0 and phases[k - 1] == 0):
                    continue
                count = read[k] + 1
                if phase == 3 and state[2][rank][count % 2] != tag_of(count):
                    continue   # polling: its peer's words are not there
                new_phases = phases[:k] + (phase + 1,) + phases[k + 1:]
                new_read, new_counter, new_slots = read, counter, state[2]
                if phase == 0:
                    new_read = read[:k] + (counter,) + read[k + 1:]
                elif phase == 1:
                    new_counter = count
                elif phase == 2:
                    peer = list(state[2][1 - rank])
                    peer[count % 2] = tag_of(count)
                    new_slots = (state[2][0], tuple(peer)) if rank == 0 else (tuple(peer), state[2][1])
                ranks = [state[0], state[1]]
                ranks[rank] = (new_counter, new_phases, new_read)
                moves.append((ranks[0], ranks[1], new_slots))
        return moves

    def records_of(state) -> tuple[frozenset, frozenset]:
        records = []
        for rank in (0, 1):
            _, phases, read = state[rank]
            stalled = [(tag_of(read[k] + 1), state[2][rank][(read[k] + 1) % 2], state[2][rank][read[k] % 2])
                       for k, phase in enumerate(phases) if phase == 3]
            records.append(frozenset((a[0], b[1], c[2]) for a in stalled for b in stalled for c in stalled))
        return records[0], records[1]

    ends = stuck_ends(((last, idle, idle), (last, idle, idle), (slots, slots)), moves_of, records_of)
    return {records for records in ends if any(records)}


def split_lanes_ends(calls: int, rank: int, at: int) -> set[tuple[Any, Any]]:
    """Every stalled end when rank `rank`'s call `at` has its program's lanes split in two: the lanes
    of warp 0, whose thread 0 stores the advanced count, take the call's count; the others took the
    next one, having read the counter after that store (the race of models/push_all_reduce.py's
    kernel while every thread read the count and one stored it). A rank pushes all its lanes of a
    call at once and ends the call when every lane's slot holds its tag. Ends are what the
    timeout records give (End): the tag warp 0 waits for (thread 0 writes the record), the call in
    the waiting lanes of their slot (a (lowest, highest) pair where they differ), the highest call
    in the other slot over all lanes."""
    def count(r: int, group: int, k: int) -> int:
        return k + 1 if (r, group, k) == (rank, 1, at) else k

    def moves_of(state) -> list:
        progress, slots = state
        moves = []
        for r in (0, 1):
            pushed, done = progress[r]
            if pushed < calls and pushed == done:
                k = pushed + 1
                peer = [list(group) for group in slots[1 - r]]
                for group in (0, 1):
                    c = count(r, group, k)
                    peer[group][c % 2] = tag_of(c)
                new_slots = list(slots)
                new_slots[1 - r] = tuple(tuple(group) for group in peer)
                new_progress = list(progress)
                new_progress[r] = (pushed + 1, done)
                moves.append((tuple(new_progress), tuple(new_slots)))
            if done < pushed:
                k = done + 1
                if all(slots[r][g][count(r, g, k) % 2] == tag_of(count(r, g, k)) for g in (0, 1)):
                    new_progress = list(progress)
                    new_progress[r] = (pushed, done + 1)
                    moves.append((tuple(new_progress), slots))
        return moves

    def records_of(state) -> tuple[Any, Any]:
        progress, slots = state
        ends = []
        for r in (0, 1):
            k = progress[r][1] + 1
            if k > calls:
                ends.append(None)
                continue
            counts = [count(r, g, k) for g in (0, 1)]
            held = sorted({slots[r][g][c % 2] for g, c in enumerate(counts) if slots[r][g][c % 2] != tag_of(c)})
            other = max(slots[r][g][1 - c % 2] for g, c in enumerate(counts))
            ends.append((tag_of(counts[0]), held[0] if len(held) == 1 else (held[0], held[-1]), other))
        return tuple(ends)

    zeroed = ((0, 0), (0, 0))
    return stuck_ends((((0, 0), (0, 0)), (zeroed, zeroed)), moves_of, records_of)


def fits(stall: tuple[End, End], tags: range) -> list[tuple[int, int, Call, Call]]:
    """(changes, rank, the call before the stalled one, the stalled one) for every alteration of one
    rank's two calls up to the stall (any `Call`, tags from `tags`) that ends in `stall` in some
    interleaving, the other rank and every other call as the protocol makes them; fewest changed
    fields first. Searched from where both ranks ended call `waited` - 4, through call `waited`:
    the calls before were the protocol's (its two slots keep them apart), and a rank stalled at
    `waited` pushes nothing later."""
    waited = stall[0][0]
    window = [(k, k % 2, k, k % 2) for k in range(waited - 3, waited + 1)]
    slots = in_step_slots(waited - 4)   # where both ranks' slots are when the window starts
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
    parser.add_argument("--kernels", type=int, default=3,
                        help="each rank's overlapping kernels, from the call before the stalled one (default 3; "
                             "4 takes about 75 s more)")
    args = parser.parse_args(argv)
    stall = tuple(tuple(int(x) for x in end.split(",")) for end in args.stall)
    reached = []
    for name, sequences, depth in variants(args.calls, range(args.around[0], args.around[1] + 1)):
        if stall in end_states(sequences, depth):
            reached.append(name)
            print(f"reachable: {name}")
    print(f"the stall {args.stall[0]} / {args.stall[1]} is reachable in {len(reached)} variant(s)")
    waited = stall[0][0]
    overlapping = any(stall[0] in records[0] and stall[1] in records[1]
                      for records in overlapping_records(waited - 1, args.kernels))
    print(f"with a rank's kernels overlapping (calls {waited - 1}..{waited + args.kernels - 2}): "
          f"{'reachable' if overlapping else 'not reachable'}")
    if overlapping:
        reached.append("kernels overlapping")
    split = [(rank, at) for rank in (0, 1) for at in range(args.around[0], args.around[1] + 1)
             if at <= args.calls and stall in split_lanes_ends(args.calls, rank, at)]
    print("with a program's lanes split (warps that read the count after its store take the next): "
          + ("; ".join(f"reachable at rank {rank}'s call {at}" for rank, at in split) or "not reachable"))
    reached += [f"lanes split at rank {rank}'s call {at}" for rank, at in split]
    found = fits(stall, range(max(1, waited - 3), waited + 3))
    print(f"{len(found)} alteration(s) of one rank's calls {waited - 1} and {waited} reach it "
          "((tag pushed, slot pushed to or None: lost, tag waited for, slot polled) of each):")
    for changes, rank, before, at in found[:10]:
        print(f"  {changes} field(s) changed: rank {rank}, call {waited - 1} {before}, call {waited} {at}")
    return 1 if reached else 0


if __name__ == "__main__":
    raise SystemExit(main())
