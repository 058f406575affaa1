"""The test-side check of greedy answers (tests/greedy.py): equal, or split at near ties only, each
followed by the reference's greedy continuation of the accepted branch (computed by a fake here)."""

import asyncio

from actors.protocol.request import TokenLogprob
from greedy import divergence, exact_divergence


def pos(*pairs):
    return tuple(TokenLogprob(t, lp) for t, lp in pairs)


def sure(token):
    return pos((token, -0.1), (3, -4.0))


PROMPT = [100, 101]
REF = [5, 6, 7, 8]
LPS = (pos((5, -0.1), (9, -3.0)), pos((6, -0.69), (1, -0.70)), pos((7, -0.2), (2, -2.5)), pos((8, -0.1), (3, -4.0)))


class Continuations:
    """A fake engine's greedy continuations, by prefix; records what it was asked."""

    def __init__(self, by_prefix):
        self.by_prefix = by_prefix
        self.asked = []

    async def __call__(self, prefix, n):
        self.asked.append((tuple(prefix), n))
        ids, lps = self.by_prefix[tuple(prefix)]
        return ids[:n], lps[:n]


def check(answer, continuations=None):
    return asyncio.run(divergence(answer, REF, LPS, PROMPT, continuations or Continuations({})))


def test_equal_answers_pass_and_ask_for_no_continuation():
    cont = Continuations({})
    assert (check(REF, cont), cont.asked) == (None, [])


def test_a_split_at_a_near_tie_then_the_branchs_greedy_continuation_passes():
    cont = Continuations({(100, 101, 5, 1): ([4, 4], (sure(4), sure(4)))})
    assert (check([5, 1, 4, 4], cont), cont.asked) == (None, [((100, 101, 5, 1), 2)])


def test_after_a_near_tie_a_token_off_the_branchs_continuation_fails():
    cont = Continuations({(100, 101, 5, 1): ([4, 4], (sure(4), sure(4)))})
    problem = check([5, 1, 4, 9], cont)
    assert problem.startswith("first differs at token 3, where the reference's best token led by 3.9000"), problem


def test_a_second_near_tie_on_the_branch_is_accepted_the_same_way():
    tie = pos((4, -0.70), (2, -0.72))
    cont = Continuations({(100, 101, 5, 1): ([4, 4], (tie, sure(4))), (100, 101, 5, 1, 2): ([7], (sure(7),))})
    assert (check([5, 1, 2, 7], cont), [p for p, _ in cont.asked]) == (None, [(100, 101, 5, 1), (100, 101, 5, 1, 2)])


def test_a_split_at_the_last_token_needs_no_continuation():
    lps = LPS[:3] + (pos((8, -0.50), (3, -0.52)),)
    cont = Continuations({})
    assert (asyncio.run(divergence([5, 6, 7, 3], REF, lps, PROMPT, cont)), cont.asked) == (None, [])


def test_a_branch_that_ends_early_leaves_an_answer_too_long():
    cont = Continuations({(100, 101, 5, 1): ([4], (sure(4),))})  # the branch meets EOS after one token
    assert check([5, 1, 4, 4], cont).startswith("lengths differ: 4 vs 3 tokens")


def test_a_split_where_the_reference_was_sure_fails():
    assert "led by 2.3000" in check([5, 6, 2, 8])


def test_a_split_to_a_token_outside_the_best_two_fails():
    assert "neither of the reference's two best" in check([5, 3, 7, 8])


def test_a_cut_answer_fails():
    assert "lengths differ" in check([5, 6])


def test_exact_equality_names_the_first_difference():
    assert (exact_divergence(REF, REF), exact_divergence([5, 1, 7, 8], REF)) == \
        (None, "first differs at token 1: 1 vs 6")
