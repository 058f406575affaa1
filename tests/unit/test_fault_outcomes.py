"""benchmarks/faults.py's pure parts: each request's outcome, the per-phase figures, the check."""

from __future__ import annotations

from benchmarks import faults as faults_bench  # noqa: F401 - puts benchmarks/ on sys.path (`pdbench`)
from pdbench import fault_client, fault_outcomes, fault_ties
from pdbench.fault_outcomes import CUT, ERROR, HUNG, RIGHT, TIE, WRONG, Outcome, Stream, Window, aggregate, classify


def test_a_complete_answer_equal_to_the_reference_is_right():
    assert classify(Stream(0, 0.0, status=200, text="abc", done=True, end_s=1.0), "abc").kind == RIGHT


def test_a_complete_200_answer_with_another_text_is_wrong():
    assert classify(Stream(0, 0.0, status=200, text="abd", done=True, end_s=1.0), "abc").kind == WRONG


def test_a_stream_ending_without_done_or_error_is_cut():
    assert classify(Stream(0, 0.0, status=200, text="ab", done=False, end_s=1.0), "abc").kind == CUT


def test_a_transport_failure_is_cut_even_before_a_response():
    assert classify(Stream(0, 0.0, transport_error="ConnectError: refused", end_s=0.1), "abc").kind == CUT


def test_an_error_event_is_a_clean_error_even_with_done():
    s = Stream(0, 0.0, status=200, text="a", done=True, error_event='{"message": "engine died"}', end_s=1.0)
    assert classify(s, "abc").kind == ERROR


def test_an_http_error_status_is_a_clean_error():
    assert classify(Stream(0, 0.0, status=503, end_s=0.2), "abc").kind == ERROR


def test_no_outcome_within_the_limit_is_hung():
    assert classify(Stream(0, 0.0, status=200, text="a", timed_out=True, end_s=120.0), "abc").kind == HUNG


def test_first_difference_is_the_first_differing_char():
    assert fault_outcomes.first_difference("abXd", "abcd") == 2


def _phase() -> list[Outcome]:
    return [Outcome(0, RIGHT, 0.0, 2.0), Outcome(1, RIGHT, 3.0, 8.0), Outcome(2, ERROR, 6.0, 6.5),
            Outcome(3, RIGHT, 7.0, 12.0), Outcome(4, WRONG, 8.0, 14.0), Outcome(5, RIGHT, 20.0, 40.0)]


def test_aggregate_counts_each_outcome_once():
    f = aggregate(_phase(), Window(fault_s=5.0, until_s=35.0, end_s=45.0))
    assert (f.sent, f.counts) == (6, {RIGHT: 4, WRONG: 1, TIE: 0, CUT: 0, HUNG: 0, ERROR: 1})


def test_wrong_rate_is_over_the_complete_200_answers():
    assert aggregate(_phase(), Window(5.0, 35.0, 45.0)).wrong_rate == 0.2


def test_goodput_splits_right_answers_by_completion_time():
    f = aggregate(_phase(), Window(fault_s=5.0, until_s=35.0, end_s=45.0))
    assert (f.goodput_before, f.goodput_during, f.goodput_after) == (0.2, round(2 / 30, 4), 0.1)


def test_first_good_counts_only_requests_sent_after_the_fault():
    assert aggregate(_phase(), Window(fault_s=5.0, until_s=35.0, end_s=45.0)).first_good_s == 7.0


def test_the_check_lists_raypds_wrong_cut_and_hung_only():
    f = aggregate([Outcome(0, CUT, 0.0, 1.0), Outcome(1, ERROR, 0.0, 1.0)], Window(0.5, 2.0, 3.0))
    assert fault_outcomes.bad_of_raypd({"b": {"kill": f}, "c": {"kill": f}}, {"b"}) == ["b kill: {'cut': 1}"]


def test_false_kills_skip_the_phases_that_stopped_an_engine():
    trail = [{"phase": "reference", "counts": {"hang_kills": 1.0}},
             {"phase": "decode SIGSTOP", "counts": {"hang_kills": 1.0}}]
    assert fault_outcomes.false_kills(trail, {"decode SIGSTOP"}) == 1.0


def test_prompts_and_arrivals_are_the_same_for_every_caller():
    assert (fault_client.prompts(0, 3, 8, 49152), fault_client.arrivals(0, 4, 0.3)) == \
           (fault_client.prompts(0, 3, 8, 49152), fault_client.arrivals(0, 4, 0.3))


def test_a_mismatch_at_a_near_tie_is_a_tie_not_wrong():
    s = Stream(0, 0.0, status=200, text="abd", done=True, end_s=1.0)
    assert classify(s, "abc", tie_gap=0.03).kind == TIE


def test_a_mismatch_past_the_near_tie_bound_is_wrong():
    s = Stream(0, 0.0, status=200, text="abd", done=True, end_s=1.0)
    assert classify(s, "abc", tie_gap=0.4).kind == WRONG


def test_near_ties_count_in_goodput_and_not_in_the_wrong_rate():
    f = aggregate([Outcome(0, TIE, 0.0, 10.0), Outcome(1, RIGHT, 0.0, 12.0)], Window(5.0, 15.0, 20.0))
    assert (f.wrong_rate, f.goodput_during) == (0.0, 0.2)


def test_divergence_token_is_the_first_reference_token_not_carried():
    assert fault_ties.divergence_token([" the", " cat", " sat"], " the dog sat") == 1


def test_no_divergence_token_when_every_reference_token_is_carried():
    assert fault_ties.divergence_token([" the", " cat"], " the cat") is None
