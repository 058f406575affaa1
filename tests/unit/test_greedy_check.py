"""The test-side check of greedy answers (tests/greedy.py): equal, or split at a near tie only."""

from actors.protocol.request import TokenLogprob
from greedy import divergence


def pos(*pairs):
    return tuple(TokenLogprob(t, lp) for t, lp in pairs)


REF = [5, 6, 7, 8]
LPS = (pos((5, -0.1), (9, -3.0)), pos((6, -0.69), (1, -0.70)), pos((7, -0.2), (2, -2.5)), pos((8, -0.1), (3, -4.0)))


def test_equal_answers_pass():
    assert divergence(REF, REF, LPS) is None


def test_a_split_at_a_near_tie_to_the_runner_up_passes_whatever_follows():
    assert divergence([5, 1, 4, 4], REF, LPS) is None


def test_a_split_where_the_reference_was_sure_fails():
    assert "led by 2.3000" in divergence([5, 6, 2, 8], REF, LPS)


def test_a_split_to_a_token_outside_the_best_two_fails():
    assert "neither of the reference's two best" in divergence([5, 3, 7, 8], REF, LPS)


def test_a_cut_answer_fails():
    assert "lengths differ" in divergence([5, 6], REF, LPS)
