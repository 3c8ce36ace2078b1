"""Several reference answers (RLinf's `solutions`, a verl ground-truth list): the math reward counts a response as
correct when its answer matches any of them, in the pool's processes and in the caller's quick path alike."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rlinf_pipe.engines.reward import RewardContext, RewardPool, ScoreConfig, score
from rlinf_pipe.engines.reward.verify import quick_score


def test_a_response_is_correct_when_it_matches_any_reference():
    refs = ["\\frac{1}{2}", "0.5", "50\\%"]
    assert score("\\boxed{1/2}", refs).correct and score("\\boxed{0.5}", refs).correct
    assert not score("\\boxed{0.4}", refs).correct and score("\\boxed{0.4}", refs).parsed
    assert score("\\boxed{7}", ["3", "7"]).correct and not score("\\boxed{7}", ["3", "8"]).correct
    assert score("\\boxed{7}", RewardContext(("3", "7"))).correct  # (what the reward worker passes)
    assert score("\\boxed{7}", ("7",)) == score("\\boxed{7}", "7")


def test_quick_score_decides_integer_references_and_leaves_the_rest_to_the_pool():
    cfg = ScoreConfig()
    assert quick_score("\\boxed{8}", ["3", "8"], cfg).correct
    assert quick_score("\\boxed{8}", ["x", "8"], cfg).correct  # (an integer reference that matches decides)
    assert not quick_score("\\boxed{9}", ["3", "8"], cfg).correct
    assert quick_score("\\boxed{9}", ["3", "9.0"], cfg) is None  # 9.0 may equal it: math-verify decides
    assert quick_score("no answer", ["3", "x"], cfg).parsed is False


_REF = st.sampled_from(["3", "-3", "8", "8.0", "\\frac{16}{2}", "x", "1,000", "1000", "007"])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["3", "-3", "8", "7", "1000", "7.0", ""]), st.lists(_REF, min_size=1, max_size=3))
def test_quick_score_with_several_references_agrees_with_score(answer, refs):
    response = f"so \\boxed{{{answer}}}" if answer else "no box"
    quick = quick_score(response, refs)
    if quick is not None:
        assert quick == score(response, refs), (response, refs)


def test_the_pool_scores_reference_lists_and_contexts():
    pairs = [("\\boxed{0.5}", ["\\frac{1}{2}", "1/2"]), ("\\boxed{2}", RewardContext(("1", "2"))),
             ("\\boxed{5}", RewardContext(("1", "2"))), ("\\boxed{\\frac{2}{4}}", ("0.5",))]
    with RewardPool(num_workers=1, timeout_s=10.0) as pool:
        assert [r.correct for r in pool.score_batch(pairs)] == [True, True, False, True]
