"""scripts/push_protocol_model.py: the protocol in step ends with every call done; a skipped count,
calls in flight, a counter's upper half altered (or the count plus 2^32 - 1) or kernels of a rank
overlapping can stall it, and the model finds those stalls; a stall with a tag in the slot of the
other parity is reachable only with a call's lanes split, some taking the next count; and `fits`
finds the alteration of a rank's calls that made a stall, fewest changes first."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import push_protocol_model as model  # noqa: E402


def test_in_step_every_call_ends():
    assert model.end_states([model.counted(10), model.counted(10)]) == {(None, None)}


def test_a_skipped_count_stalls_both_ranks():
    # rank 1 counts 6 at its fifth call: rank 0 waits for 5 (slots 3, then 6), rank 1 for 6 (4, 5)
    assert ((5, 3, 6), (6, 4, 5)) in model.end_states([model.counted(10), model.counted(10, 5, 6)])


def test_two_calls_in_flight_break_the_two_slots():
    ends = model.end_states([model.counted(10), model.counted(10)], in_flight=2)
    assert ((2, 4, 5), (4, 2, 3)) in ends   # a rank's next push overwrote the slot its peer still waited on


def test_a_counters_upper_half_altered_puts_tags_in_the_other_paritys_slot():
    # count 3 + 2^32: tag 4 (the tag wraps modulo 2^32 - 1) in the slot of 3's parity
    assert model.counted(6, 3, 3 + (1 << 32))[2] == (4, 1, 4, 1)
    # rank 1 from call 5 on: rank 0 waits for 5 with 6 in that slot, rank 1 for 6 with 5 there
    assert model.end_states([model.counted(12), model.counted(12, 5, 5 + (1 << 32))]) == {((5, 6, 4), (6, 5, 4))}


def test_a_count_plus_2_to_the_32_minus_1_keeps_its_tag_in_the_other_slot():
    assert model.counted(6, 3, 3 + 0xFFFFFFFF)[2] == (3, 0, 3, 0)
    # rank 1 from call 5 on: each rank pushes and waits for call 5 in the slot the other does not
    # use; or rank 1's call 5 overwrote its call 4 in that slot before rank 0 had read it
    assert model.end_states([model.counted(12), model.counted(12, 5, 5 + 0xFFFFFFFF)]) == {
        ((5, 3, 5), (5, 4, 5)), ((4, 5, 3), (5, 4, 3))}


def test_overlapping_kernels_that_read_the_same_count_stall_the_peer():
    # two kernels of a rank both read count 4: both make call 5, so the peer's call 6 never gets words
    ends = model.overlapping_records(5, 2)
    assert (frozenset(), frozenset({(6, 4, 5)})) in ends and (frozenset({(6, 4, 5)}), frozenset()) in ends


def test_main_says_which_variant_reaches_a_stall(capsys):
    assert model.main(["--calls", "10", "--stall", "5,3,6", "6,4,5", "--around", "1", "10"]) == 1
    assert "reachable: rank 1's count skipped at call 5" in capsys.readouterr().out


def test_a_tag_in_the_other_paritys_slot_needs_a_calls_lanes_split(capsys):
    # the shape of the recorded stall: rank 1 waits for call 6 and its slot of 6's parity holds 5;
    # no count, overlap or shift of a program's lanes together gives it, rank 1's call 6 split does
    assert model.main(["--calls", "12", "--stall", "6,4,7", "6,5,6", "--around", "1", "12"]) == 1
    out = capsys.readouterr().out
    assert "reachable in 0 variant(s)" in out and "kernels overlapping (calls 5..7): not reachable" in out
    assert "lanes split (warps that read the count after its store take the next): reachable at rank 1's call 6\n" in out


def test_a_call_whose_late_warps_take_the_next_count_stalls_as_recorded():
    # rank 1's call 38: warp 0's lanes push and wait for 38, the late warps' lanes for 39 (in 39's
    # slot); rank 0 waits for the late lanes' 38, which never come. The records of the stall:
    assert ((38, 36, 39), (38, 37, 38)) in model.split_lanes_ends(45, 1, 38)
    assert model.split_lanes_ends(12, 1, 100) == {(None, None)}   # no call split: every call ends


def test_fits_finds_the_alteration_that_made_a_stall_fewest_changes_first():
    normal = model.counted(12)
    skipped = list(normal)
    skipped[5] = (7, 1, 7, 1)          # rank 1's sixth call counted 7: pushes and waits for call 7
    stall = ((6, 4, 7), (7, 5, 6))
    assert stall in model.end_states([normal, skipped])
    found = model.fits(stall, range(3, 9))
    assert (4, 1, normal[4], (7, 1, 7, 1)) in found
    assert [fit[0] for fit in found] == sorted(fit[0] for fit in found)
    for _, rank, before, at in found:   # each fit reaches the stall from the start too
        altered = [*normal[:4], before, at, *normal[6:]]
        assert stall in model.end_states([altered, normal] if rank == 0 else [normal, altered])
