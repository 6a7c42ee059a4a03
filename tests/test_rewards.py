"""Reward functions: built-ins, dotted paths, async functions, weights, failures and non-finite scores that
score 0 (never reaching the advantages), mistakes refused before training, and a reward failing on every
sample stopping the step."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import json
import re
import signal
import sys
import threading
import time

import pytest
import torch

from lightning_rl.errors import RecipeError
from lightning_rl.losses import group_advantages
from lightning_rl.rewards import RewardScorer, RewardSpec
from lightning_rl.rewards.scoring import RewardContractError, RewardFailedError, load_reward_function
from lightning_rl.rewards.builtin import extract_answer, format_match, math_answer, tool_call_validity


def test_math_answer_reads_boxed_tags_or_the_last_number():
    assert extract_answer("so \\boxed{12} it is") == "12"
    assert extract_answer("<answer> 7 </answer> and 9") == "7"
    assert extract_answer("3 then 4.5") == "4.5"
    assert extract_answer("no digits") is None
    completions = ["54", "it is 54.0", "\\boxed{3}", "1 7 0 4", "1 7 0", "55"]
    answers = ["54", "54", "3", "1 7 0 4", "1 7 0 4", "54"]
    assert math_answer(completions, answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert math_answer(["None", "2"], [None, 2]) == [None, 1.0]  # a null answer (Parquet's missing value): no score
    # Thousands separators: "1,234" is 1234 (it read as 234, scoring a reply of 1234 wrong and one of 234 right).
    separated = ["The answer is 1,234.", "The total is 1,234.", "\\boxed{1,000}", "-12,345.5", "1,2,3", "1,234"]
    assert math_answer(separated, ["1234", "234", 1000, -12345.5, 3, "1,234"]) == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]



MATH_ANSWERS = [  # (completion, answer, score): each once scored the other way (or, for the empty answer, at all)
    (r"My answer is \boxed{\frac{1}{3}}", "3", 0.0),  # nested braces: the whole box, not its last bare number
    (r"\boxed{\sqrt{2}}", "2", 0.0), (r"\boxed{2^{10}}", "10", 0.0), (r"\fbox{\dfrac{3}{4}}", "4", 0.0),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{3}", 1.0), (r"\boxed{1/2}", "1/2", 1.0), (r"\boxed{0.5}", "1/2", 1.0),
    (r"\boxed{-\tfrac{1}{2}}", "$-0.5$", 1.0), (r"\boxed{\left( 3, 4 \right)}", "( 3, 4 )", 1.0),
    ("999999", 1000000, 0.0), ("1000001", 1e6, 0.0), ("0.3333333", 1 / 3, 1.0),  # whole numbers exact; a float gold to 1e-6
    ("\u22123", "-3", 1.0), ("1e3", "3", 0.0), (".5", "5", 0.0), ("Pages 10-15", "-15", 0.0), ("10^6", "6", 0.0),
    ("05", "5", 1.0), (r"\boxed{x=3}", "3", 1.0), (r"\boxed{12 \text{cm}}", "12", 0.0), (r"\boxed{5 million}", "5", 0.0), (r"\boxed{2x}", "2", 0.0), (r"\boxed{\$18}", "18", 1.0),
    (r"\boxed{50\%}", "50", 1.0), (r"\boxed{1{,}000}", "1000", 1.0), ("<answer>The final answer is 42</answer>", "42", 1.0),
    (r"\boxed{10}", "x^2+7x+10", 0.0), (r"\boxed{1}", "n-1", 0.0), (r"\boxed{3}", "3!", 0.0), (r"\boxed{x+10}", "10", 0.0),
    (r"\boxed{2}", r"\text{Option } 2", 0.0), ("He walked 12km", "12", 1.0), ("答案是18", 18, 1.0), (r"So \(x = 18\).", 18, 1.0),
    ("The answer is __18__", "18", 1.0), (r"The answer is \(\frac{1}{2}\)", "0.5", 1.0),
    ("The answer is 3/4", "4", 0.0), (r"\boxed{72}", "She sold 48 + 24 = 72 clips. #### 72", 1.0), (r"\boxed{90^{\circ}}", "90", 1.0),
    (r"\boxed{\mathbf{72}}", "72", 1.0), (r"\boxed{(3, 4)}", "(3,4)", 1.0), (r"\boxed{72} \boxed{}", "72", 1.0),
    ("<think>maybe \\boxed{5}</think> The answer is 7", "7", 1.0),  # a box among the thoughts is no answer
    (r"\boxed{(3,4)}", "4", 0.0), ("", "", None), ("nan", float("nan"), None), ("True", True, 1.0), ("1", True, 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "score"), MATH_ANSWERS)
def test_math_answer_reads_latex_fractions_and_units_exactly(completion, answer, score):
    assert math_answer([completion], [answer]) == [score]


def test_math_answer_reads_unclosed_answer_tags_in_one_pass():
    """Many unclosed tags (a collapsing policy's text) were read in quadratic time: minutes for one completion, past
    reward_timeout_s for a batch. Read in one pass, this returns at once (no timing asserted: a slow machine is no bug)."""
    assert math_answer(["<answer>" * 10_000 + r"\boxed{" * 10_000], ["1"]) == [0.0]


def test_format_and_tool_call_validity():
    assert format_match(["<answer>1</answer>", "x <answer>1</answer>"]) == [1.0, 0.0]
    assert format_match(["12", "a1"], pattern=r"\d+$") == [1.0, 0.0]
    calls = [[{"failure": None}, {"failure": "invalid_arguments"}], [], [{"failure": None}]]
    assert tool_call_validity(["", "", ""], calls) == [0.5, 0.0, 1.0]
    assert tool_call_validity(["", "", ""], calls, no_call_score=1.0)[1] == 1.0


def length_bonus(completions, **_):
    return [len(c) / 10 for c in completions]


async def slow_exact(completions, answer, **_):
    await asyncio.sleep(0.01)
    return [float(c == a) for c, a in zip(completions, answer)]


def picky(completions, **_):
    for c in completions:
        if "boom" in c:
            raise RuntimeError("cannot score boom")
    return [1.0] * len(completions)


def test_weighted_sum_of_builtin_dotted_path_and_async_functions():
    scorer = RewardScorer([
        RewardSpec("math_answer", weight=2.0),
        RewardSpec("test_rewards:length_bonus", weight=0.5),
        RewardSpec(slow_exact, name="exact"),
    ])
    scores = scorer.score(["q1", "q2"], ["4", "five"], {"answer": ["4", "5"]})
    assert scores.per_function["math_answer"].tolist() == [1.0, 0.0]
    assert scores.per_function["length_bonus"].tolist() == pytest.approx([0.1, 0.4])
    assert scores.per_function["exact"].tolist() == [1.0, 0.0]
    assert scores.total.tolist() == pytest.approx([2.0 + 0.05 + 1.0, 0.2])
    assert scores.errors == []


def test_a_raising_reward_scores_only_the_failing_sample_zero_and_is_logged(caplog):
    scorer = RewardScorer([RewardSpec(picky), RewardSpec("math_answer")])
    with caplog.at_level(logging.WARNING):
        scores = scorer.score(["a", "b", "c"], ["1", "boom", "3"], {"answer": ["1", "2", "3"]})
    assert scores.per_function["picky"].tolist() == [1.0, 0.0, 1.0]
    assert scores.total.tolist() == [2.0, 0.0, 2.0]
    (error,) = scores.errors
    assert (error.function, error.sample, error.completion) == ("picky", 1, "boom")
    assert "RuntimeError: cannot score boom" in error.error
    assert "reward 'picky' failed on sample 1" in caplog.text


def test_a_raising_reward_can_be_made_fatal_in_one_line_naming_it_the_step_and_where_it_raised():
    scorer = RewardScorer([RewardSpec(picky)], on_error="raise")
    with pytest.raises(RewardFailedError, match=r"^step 2: reward 'picky' raised RuntimeError: cannot score boom at .*test_rewards\.py:\d+ \(reward_on_error: raise\)$") as raised:
        scorer.score(["a"], ["boom"], {}, step=2)
    assert isinstance(raised.value.__cause__, RuntimeError) and raised.value.key == "rewards"  # the traceback kept


@pytest.mark.parametrize("on_error", ["zero", "raise"])
def test_a_reward_that_breaks_its_contract_stops_the_run_in_one_line(on_error):
    """One score (or None) per completion, each a number: anything else is a bug in the function. A retry sample by
    sample would hide a count bug (one score for one sample is right), so it is not retried, under either on_error,
    nor zeroed under all_failed: zero; TRL fails on it too."""
    cases = {
        "short": ([1.0], "returned 1 scores for 2 completions"),
        "long": ([1.0, 2.0, 3.0], "returned 3 scores for 2 completions"),
        "scalar": (1.0, "returned a float, not a list of one score per completion"),
        "scalar_tensor": (torch.tensor(1.0), r"returned a 0-d Tensor \(one number\), not a list of one score per completion"),
        "text": ("10", "returned a str, not a list"),
        "strings": (["1.0", 2.0], r"returned '1.0' \(str\) for completion 0, not a number or None"),
    }
    for name, (returned, message) in cases.items():
        scorer = RewardScorer([RewardSpec(lambda completions, _r=returned, **_: _r, name=name)], on_error=on_error, all_failed="zero")
        with pytest.raises(RewardContractError, match=rf"^step 3: reward '{name}' {message}") as refused:
            scorer.score(["a", "b"], ["x", "y"], {}, step=3)
        assert refused.value.key == "rewards"
    numpy = pytest.importorskip("numpy")
    scorer = RewardScorer([RewardSpec(lambda completions, **_: numpy.array([1.5, True]), name="array")])
    assert scorer.score(["a", "b"], ["x", "y"], {}).total.tolist() == [1.5, 1.0]  # numbers of any kind pass
    scorer = RewardScorer([RewardSpec(lambda completions, **_: [torch.tensor(0.5), None, numpy.bool_(True)], name="mixed")])
    assert scorer.score(["a", "b", "c"], ["x", "y", "z"], {}).per_function["mixed"].tolist()[::2] == [0.5, 1.0]


def test_a_failed_call_is_retried_a_prompt_at_a_time_so_a_reward_comparing_completions_keeps_its_scores(caplog):
    """A reward that compares a prompt's completions (1 for the shortest) and fails on one prompt: the retry sample by
    sample scored each other completion alone, the shortest of its one-sample batch, so every one got 1 silently.
    Retried a prompt's completions at a time, the other prompt keeps its scores; the failing one, each alone, said."""
    def shortest(prompts, completions, **_):
        if "bad" in prompts:
            raise ValueError("cannot score this prompt")
        return [float(len(c) == min(len(d) for q, d in zip(prompts, completions) if q == p)) for p, c in zip(prompts, completions)]

    scorer = RewardScorer([RewardSpec(shortest, name="shortest")])
    scores = scorer.score(["ok"] * 3 + ["bad"] * 2, ["a", "bb", "ccc", "d", "ee"], {}, step=1)
    assert scores.per_function["shortest"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [(e.sample, e.kind) for e in scores.errors] == [(3, "raised"), (4, "raised")]
    assert "failed on the completions of prompt 'bad' together: each is scored alone" in caplog.text
    # Prompts of one completion each (interleaved): a completion that failed alone is not called alone once more.
    calls = []

    def counted(completions, **_):
        calls.append(list(completions))
        if "bad" in completions:
            raise ValueError("bad")
        return [1.0] * len(completions)

    scores = RewardScorer([RewardSpec(counted, name="counted")]).score(["p", "q", "p", "q"], ["a", "bad", "c", "d"], {})
    assert scores.per_function["counted"].tolist() == [1.0, 0.0, 1.0, 1.0] and calls[1:] == [["a"], ["bad"], ["c"], ["d"]]
    calls.clear()
    scores = RewardScorer([RewardSpec(counted, name="counted")], all_failed="zero").score(["p"], ["bad"], {})
    assert calls == [["bad"]] and [(e.sample, e.kind) for e in scores.errors] == [(0, "raised")]  # one call, one failure
    assert "step 1: reward 'shortest' failed on sample 3 of 5 (prompt 'bad', completion 'd'): ValueError" in caplog.text


def test_bad_reward_specs_are_refused_by_name():
    with pytest.raises(ValueError, match="is neither one of format, math_answer, overlong_penalty, reward_model, tool_call_validity nor a dotted path"):
        RewardScorer([RewardSpec("nonsense")])
    with pytest.raises(ValueError, match="no module 'no_such_module' in .*the installed packages"):
        RewardScorer([RewardSpec("no_such_module.fn")])
    with pytest.raises(RecipeError, match=r"names must be unique: 'math_answer' names rewards\[0\] too") as twice:
        RewardScorer([RewardSpec("math_answer"), RewardSpec("format"), RewardSpec("math_answer")])
    assert twice.value.within("model").line().startswith("model.rewards[2].name: reward function names must be unique")


def test_a_file_name_or_a_file_hidden_by_an_installed_module_is_said(tmp_path, monkeypatch):
    from lightning_rl.dotted import set_import_folders

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    (tmp_path / "code.py").write_text("def probe(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    (tmp_path / "rewards").mkdir(), (tmp_path / "rewards" / "mine.py").write_text((tmp_path / "code.py").read_text())
    set_import_folders({tmp_path: "the recipe's folder"})
    try:
        with pytest.raises(ValueError, match=rf"module 'code' has no 'probe' \(code in the recipe's folder {re.escape(str(tmp_path))} is hidden by the module of that name imported from .*code.py, which comes first: rename your file\)$"):
            RewardScorer([RewardSpec("code:probe")])
        with pytest.raises(ValueError, match=r"'rewards/mine.py:probe' names a file; name its module, without .py: rewards.mine:probe$"):
            RewardScorer([RewardSpec("rewards/mine.py:probe")])
        with pytest.raises(ValueError, match=r"'json:nothing': module 'json' has no 'nothing'$"):  # nothing of the recipe's hidden
            RewardScorer([RewardSpec("json:nothing")])
        with pytest.raises(ValueError, match=r"'email.py:probe': no module 'email.py'"):  # a dotted path ending in py, no file
            RewardScorer([RewardSpec("email.py:probe")])
    finally:
        set_import_folders({})


class Judge:
    def __call__(self, completions, **_):
        return [1.0] * len(completions)


def test_rewards_are_named_as_given_or_as_trl_names_callables(tmp_path, monkeypatch):
    """An explicit name was cut at its last '.' (two names 'strict.format' and 'loose.format' were refused as the
    same); a partial or a callable object, which TRL takes, was a TypeError or an AttributeError."""
    from lightning_rl.modules.grpo_options import reward_spec

    specs = [RewardSpec("format", name="strict.format"), RewardSpec("format", name="loose.format"),
             reward_spec(functools.partial(picky)), reward_spec(Judge()), reward_spec(length_bonus)]  # fmt: skip
    assert list(RewardScorer(specs).rewards) == ["strict.format", "loose.format", "picky", "Judge", "length_bonus"]
    assert [spec.as_config()["function"] for spec in specs[2:]] == ["test_rewards:picky", "test_rewards:Judge", "test_rewards:length_bonus"]
    # A module that fails as it imports, a class that fails as it is built, and a hub id: one line each.
    (tmp_path / "needs_key.py").write_text("import os\nKEY = os.environ['JUDGE_API_KEY']\ndef r(completions, **_): return [0.0]\n")
    (tmp_path / "bad_init.py").write_text("class R:\n    def __init__(self):\n        raise RuntimeError('no service')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, message in (("needs_key:r", "reward function 'needs_key:r': importing 'needs_key' raised KeyError: 'JUDGE_API_KEY'"),
                          ("bad_init:R", "reward 'R': cannot be built from kwargs {}: RuntimeError: no service"),
                          ("Skywork/Skywork-Reward-V2-Qwen3-0.6B", "is a path, not a dotted path (pkg.module:name); a reward model is "
                           "`function: reward_model` with `kwargs: {path: Skywork/Skywork-Reward-V2-Qwen3-0.6B}`")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            RewardScorer([RewardSpec(spec)])
    # TRL's reward_funcs take a reward model object too: refused as it is read, not on every sample at the first step.
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    model = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                       num_attention_heads=2, num_key_value_heads=1, num_labels=1))
    model.name_or_path = "my/reward-model"
    with pytest.raises(ValueError, match=re.escape("reward 'Qwen2ForSequenceClassification' is a model object, not a reward function; a "
                                                   "reward model is `function: reward_model` with `kwargs: {path: my/reward-model}`")):
        RewardScorer([reward_spec(model)])


def non_finite(completions, **_):
    return [{"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"), "huge": 1e30}.get(c, 1.0) for c in completions]


def test_infinite_scores_are_failures_of_their_samples_and_never_reach_the_advantages_and_nan_is_none(caplog):
    """An infinite score fails its sample. A NaN is a sample the function does not apply to, as TRL reads it (it reads
    None as NaN): left out of the weighted sum, where it was a failure scoring 0."""
    completions = ["inf", "a", "-inf", "b", "nan", "c", "huge", "d"]
    scorer = RewardScorer([RewardSpec(non_finite, weight=1e10), RewardSpec("support.grpo:text_length")])
    with caplog.at_level(logging.WARNING):
        scores = scorer.score(["p"] * 8, completions, {})
    assert scores.per_function["non_finite"].tolist() == pytest.approx([0.0, 1.0, 0.0, 1.0, math.nan, 1.0, 1e30, 1.0], nan_ok=True)
    assert torch.isfinite(scores.total).all() and scores.total[4] == scores.per_function["text_length"][4]  # the other reward alone
    # 1e30 x 1e10 overflows float32: the weighted sum of that sample is a failure too.
    assert [(e.function, e.sample, e.error, e.kind) for e in scores.errors] == [
        ("non_finite", 0, "returned inf", "non_finite"), ("non_finite", 2, "returned -inf", "non_finite"),
        ("weighted sum", 6, "overflowed to inf", "non_finite"),
    ]
    assert scores.failure_counts()["non_finite"] == {"raised": 0, "non_finite": 2, "timeout": 0}
    assert "reward 'non_finite' failed on sample 0 of 8 (prompt 'p', completion 'inf'): returned inf" in caplog.text
    advantages = group_advantages(scores.total, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), "std")
    assert torch.isfinite(advantages).all() and advantages.abs().sum() > 0
    with pytest.raises(RewardFailedError, match="reward 'non_finite' returned inf for sample 0"):
        RewardScorer([RewardSpec(non_finite)], on_error="raise").score(["p"], ["inf"], {})
    # An integer past float's range is that infinity, said as such (it was an OverflowError read as a raise).
    huge = RewardScorer([RewardSpec(lambda completions, **_: [-(10**400) if c == "a" else 1 for c in completions])]).score(["p"] * 2, ["a", "b"], {})
    assert [(e.sample, e.error, e.kind) for e in huge.errors] == [(0, "returned -inf", "non_finite")]


def exact(completions, answer):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def matches(completions, pattern):
    return [float(re.match(pattern, c) is not None) for c in completions]


def positional(completions, /):
    return [1.0] * len(completions)


def test_reward_mistakes_are_refused_before_training_in_one_line():
    refused = {
        "reward 'format': kwargs {'pattern': '('} do not work: error: missing ), unterminated subpattern":
            RewardSpec("format", kwargs={"pattern": "("}),
        "reward 'format': unknown kwarg 'patern' (it takes pattern)": RewardSpec("format", kwargs={"patern": r"\\d"}),
        "reward 'math_answer': unknown kwarg 'answers'": RewardSpec("math_answer", kwargs={"answers": "1"}),
        "reward 'exact': kwarg 'completions' would replace the batch's completions":
            RewardSpec(exact, kwargs={"completions": []}),
        "reward 'positional': parameter 'completions' is positional-only": RewardSpec(positional),
        "reward 'math_answer': weight must be finite, got nan": RewardSpec("math_answer", weight=float("nan")),
    }  # fmt: skip
    for message, spec in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)) as caught:
            RewardScorer([spec])
        assert "\n" not in str(caught.value)
    scorer = RewardScorer([RewardSpec("math_answer"), RewardSpec(exact), RewardSpec("tool_call_validity")])
    scorer.check_arguments(["answer", "kind", "tool_calls"])
    with pytest.raises(ValueError, match=re.escape(
        "reward 'math_answer' needs 'answer', which is neither a data column nor a reward argument "
        "(there are: completions, kind, log_extra, log_metric, prompts, tool_calls, trainer_state)"
    )):
        scorer.check_arguments(["kind", "tool_calls"])
    with pytest.raises(ValueError, match="reward 'format': kwarg 'pattern' is also a data column"):
        RewardScorer([RewardSpec("format", kwargs={"pattern": "a"})]).check_arguments(["pattern"])
    # A column named as an argument every function is given would replace it (TRL refuses the call): refused.
    scorer.check_arguments(["answer"], given=["tool_calls"])
    for column, whose in (("completions", "batch"), ("trainer_state", "batch"), ("tool_calls", "run")):
        with pytest.raises(ValueError, match=re.escape(f"the data has a column named {column!r}, the name of an argument "
                                                       f"every reward function is given (the {whose}'s): rename the column")):
            scorer.check_arguments(["answer", column], given=["tool_calls"])


def test_a_lambda_recorded_by_a_checkpoint_says_how_to_load_it_again():
    """A reward given as a lambda is recorded as `__main__:<lambda>`: loading that said "module '__main__' has no
    '<lambda>'"."""
    spec = RewardSpec(lambda completions, **_: [0.0] * len(completions))
    assert spec.as_config()["function"].endswith(":test_a_lambda_recorded_by_a_checkpoint_says_how_to_load_it_again.<locals>.<lambda>")
    with pytest.raises(ValueError, match=r"was a lambda, a function defined inside another or a partial of positional arguments, which cannot be imported again: give it as rewards="):
        RewardScorer([RewardSpec(spec.as_config()["function"])])
    # A partial's keywords are recorded as kwargs (they were dropped: loaded again, the function ran without them).
    bound = RewardSpec(functools.partial(functools.partial(length_bonus, bonus=1.0, n=2), bonus=3.0), kwargs={"n": 5})
    assert bound.as_config() == {"function": "test_rewards:length_bonus", "weight": 1.0, "kwargs": {"bonus": 3.0, "n": 5}, "name": None}
    assert "<partial" in RewardSpec(functools.partial(length_bonus, "x")).as_config()["function"]
    # A function the training script defined is recorded under __main__, which another script's __main__ lacks.
    with pytest.raises(ValueError, match=r"'__main__:score'.*defined in the script that trained \(__main__\); give it as rewards="):
        RewardScorer([RewardSpec("__main__:score")])


def test_rewards_given_alone_are_a_list_of_one_and_a_wrong_entry_names_the_key():
    """TRL's reward_funcs takes one function or a list: one alone was iterated (a name read letter by letter)."""
    from lightning_rl.errors import RecipeError
    from lightning_rl.modules.grpo_options import reward_specs

    assert [spec.function for spec in reward_specs("math_answer")] == ["math_answer"]
    assert reward_specs(length_bonus)[0].as_config()["function"] == "test_rewards:length_bonus"
    assert reward_specs({"function": "format", "weight": 2.0})[0].weight == 2.0
    with pytest.raises(RecipeError, match=r"^rewards: each entry is a name or dotted path, a function, or a block \(function, weight, kwargs\), got 3$"):
        reward_specs([3])
    with pytest.raises(RecipeError, match=r"^rewards must be a list of reward functions, got int$"):
        reward_specs(3)


def test_a_function_gets_only_the_arguments_it_names():
    # No **kwargs: the data's other columns (`kind`) and the batch's prompts are not passed to it.
    scorer = RewardScorer([RewardSpec(exact), RewardSpec(matches, kwargs={"pattern": r"\d"})])
    scores = scorer.score(["p", "q"], ["4", "x"], {"answer": ["4", "5"], "kind": ["add", "add"]})
    assert scores.per_function["exact"].tolist() == [1.0, 0.0] and scores.per_function["matches"].tolist() == [1.0, 0.0]
    assert scores.errors == []


def stop_if_failed_on_all(scorer, scores, step, reduce=lambda tensor, reduce_op: tensor):
    """The trainer's check of a step scored in one batch (`GRPOModule.training_step`); ``reduce``: the sum over ranks."""
    scorer.stop_if_failed_on_all(scores.failed_samples(), scores.first_failures(), len(scores.total), step, reduce)


def test_a_reward_failing_on_every_sample_stops_the_step_naming_it():
    # A user's regex that does not compile fails on every sample: no silent run of zeros.
    scorer = RewardScorer([RewardSpec("math_answer"), RewardSpec(matches, kwargs={"pattern": "("})])
    scores = scorer.score(["p", "q"], ["4", "x"], {"answer": ["4", "5"]}, step=3)
    with pytest.raises(RewardFailedError) as caught:
        stop_if_failed_on_all(scorer, scores, 3)
    assert str(caught.value) == (
        "step 3: reward 'matches' failed on all 2 samples, first: error: missing ), unterminated subpattern at "
        "position 0 (reward_all_failed: zero would train on with 0 instead)"
    )
    assert (caught.value.reward, caught.value.step) == ("matches", 3)
    assert scorer.stopped_by == {"reward": "matches", "step": 3, "error": caught.value.first_error}
    inf_everywhere = RewardScorer([RewardSpec(non_finite)])
    with pytest.raises(RewardFailedError, match="reward 'non_finite' failed on all 1 samples, first: returned inf"):
        stop_if_failed_on_all(inf_everywhere, inf_everywhere.score(["p"], ["inf"], {}), 1)
    lenient = RewardScorer([RewardSpec("math_answer"), RewardSpec(matches, kwargs={"pattern": "("})], all_failed="zero")
    scores = lenient.score(["p", "q"], ["4", "x"], {"answer": ["4", "5"]})
    assert scores.total.tolist() == [1.0, 0.0] and scores.failure_counts()["matches"] == {"raised": 2, "non_finite": 0, "timeout": 0}
    stop_if_failed_on_all(lenient, scores, 1)  # trains on
    # Failing on some samples only is not a stop.
    some = RewardScorer([RewardSpec(picky)])
    scores = some.score(["a", "b"], ["boom", "ok"], {})
    stop_if_failed_on_all(some, scores, 1)
    assert scores.total.tolist() == [0.0, 1.0] and some.stopped_by is None


def test_a_reward_failing_on_every_sample_of_one_rank_only_is_no_stop():
    """A step spans every rank: the counts are summed over the ranks before the check. Each rank stopped on its own
    samples, so a run on two ranks stopped where one process, scoring the same samples, trained on."""
    scorer = RewardScorer([RewardSpec(picky)])
    scores = scorer.score(["p"] * 2, ["boom", "boom"], {}, step=1)
    other_rank = torch.tensor([1.0, 2.0])  # what the other rank sends: picky failed on 1 of its 2 samples
    stop_if_failed_on_all(scorer, scores, 1, lambda tensor, reduce_op: tensor + other_rank)
    assert scorer.stopped_by is None
    all_failed = torch.tensor([2.0, 2.0])  # ... on both of its samples: every rank stops, said once
    with pytest.raises(RewardFailedError, match=r"^step 1: reward 'picky' failed on all 4 samples, first: RuntimeError: cannot score boom \(") as caught:
        stop_if_failed_on_all(scorer, scores, 1, lambda tensor, reduce_op: tensor + all_failed)
    assert caught.value.on_every_rank and scorer.stopped_by == {"reward": "picky", "step": 1, "error": "RuntimeError: cannot score boom"}


def test_a_reward_module_that_does_not_parse_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("def score(completions, **_):\n    return [1.0 for c in completions\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^reward function 'broken_rewards:score': .*broken_rewards.py:\d+: ") as caught:
        load_reward_function("broken_rewards:score")
    assert "\n" not in str(caught.value)


def hangs_on(word: str):
    def reward(completions, **_):
        if word in completions:
            time.sleep(3600)  # never returns within the test
        return [1.0] * len(completions)

    return reward


async def never_answers(completions, **_):
    await asyncio.sleep(3600)


async def blocks_its_loop(completions, **_):
    time.sleep(3)  # a blocking call inside a coroutine: it never yields to the loop (short: it holds the loop)


class AsyncCall:
    async def __call__(self, completions, **_):
        return [float(len(c)) for c in completions]


def shares_state(completions, **_):
    """Fails if another call of a plain reward runs at the same time (as a shared fast tokenizer would)."""
    global _inside
    _inside += 1
    try:
        time.sleep(0.05)
        assert _inside == 1, "two plain reward calls ran at once"
        return [1.0] * len(completions)
    finally:
        _inside -= 1


_inside = 0


def test_a_reward_that_never_returns_fails_its_samples_within_the_limit_and_the_run_can_stop():
    stuck = RewardSpec(hangs_on("stuck"), name="stuck")
    scorer = RewardScorer([stuck, RewardSpec(never_answers), RewardSpec("support.grpo:text_length")],
                          all_failed="zero", timeout_s=1.0)  # fmt: skip
    started = time.monotonic()
    scores = scorer.score(["p"] * 3, ["a", "stuck", "bb"], {})
    assert time.monotonic() - started < 5  # one limit per function and batch, not one per sample
    counts = scores.failure_counts()
    assert counts["stuck"] == counts["never_answers"] == {"raised": 0, "non_finite": 0, "timeout": 3}
    assert scores.per_function["text_length"].tolist() == pytest.approx([0.1, 0.5, 0.2])  # the others still score
    assert {e.error for e in scores.errors} == {"did not return within 1s (reward_timeout_s)"}
    # The next step is not held up by the abandoned call, and the default stops the run naming the reward.
    stopping = RewardScorer([stuck], timeout_s=1.0)
    with pytest.raises(RewardFailedError, match=r"step 4: reward 'stuck' failed on all 2 samples, first: did not return within 1s"):
        stop_if_failed_on_all(stopping, stopping.score(["p"] * 2, ["stuck", "a"], {}, step=4), 4)
    with pytest.raises(ValueError, match="reward_timeout_s must be a finite number > 0 or null, got 0"):
        RewardScorer([stuck], timeout_s=0)


def test_a_coroutine_that_blocks_still_times_out_and_async_objects_score():
    """A coroutine reward runs on a loop of its own: one that blocks (time.sleep in async def) froze the loop that
    keeps the time, so it ran to its end; an object with an async __call__ scores as a coroutine function does."""
    scores = RewardScorer([RewardSpec(AsyncCall(), name="length")], timeout_s=5.0).score(["p"] * 2, ["a", "bb"], {})
    assert scores.per_function["length"].tolist() == [1.0, 2.0]
    scores = RewardScorer([RewardSpec(blocks_its_loop)], all_failed="zero", timeout_s=0.5).score(["p"] * 2, ["a", "bb"], {})
    assert scores.failure_counts()["blocks_its_loop"]["timeout"] == 2  # before its 3 s were up


def test_plain_rewards_run_one_at_a_time_and_exit_like_a_failure():
    def exits(completions, **_):
        raise SystemExit(3)

    specs = [RewardSpec(shares_state, name=f"shared{i}") for i in range(3)] + [RewardSpec(exits)]
    scores = RewardScorer(specs, all_failed="zero").score(["p"] * 2, ["a", "b"], {})
    assert [scores.per_function[f"shared{i}"].tolist() for i in range(3)] == [[1.0, 1.0]] * 3
    assert scores.failure_counts()["exits"]["raised"] == 2 and scores.errors[0].error == "SystemExit: 3"


def test_the_overlong_penalty_is_dapos_soft_punishment():
    from trl.rewards import get_soft_overlong_punishment

    from lightning_rl.rewards.builtin import overlong_penalty

    lengths = [0, 5, 6, 7, 9, 10, 11, 30]
    ids = [[1] * n for n in lengths]
    theirs = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)(completion_ids=ids)
    assert overlong_penalty(ids, max_length=10, cache=4) == pytest.approx(theirs)
    assert overlong_penalty(ids, max_length=10, cache=4)[-3:] == [pytest.approx(-1.0), -1.0, -1.0]
    with pytest.raises(ValueError, match="reward 'overlong_penalty': kwargs .* do not work: ValueError: cache must be in"):
        RewardScorer([RewardSpec("overlong_penalty", kwargs={"max_length": 10, "cache": 0})])


def makes_nothing(scale):
    return scale


CALLS: list = []


def counts_calls(completions):
    CALLS.append(completions)
    return [len(c) for c in completions]


def refuses_its_limit(limit):
    raise ValueError("limit must be > 0")


def scores_a_column(answer=None):
    return [float(a == "5") for a in answer]


ANNOTATED_CALLS: list = []


def scores_a_column_annotated(answer=None) -> list[float]:
    ANNOTATED_CALLS.append(answer)
    return [float(a == "5") for a in answer]


def test_a_factory_named_with_its_kwargs_is_the_reward_it_returns():
    """TRL's scripts call a factory (`get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)`); a
    recipe names it with those kwargs. A function that takes nothing but its kwargs sees no completion, so it is
    called once, before training, and what it returns scores, named as TRL names it; failed at the first step before."""
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in (3, 7, 9, 12)]
    kwargs = {"max_completion_len": 10, "soft_punish_cache": 4}
    theirs = get_soft_overlong_punishment(**kwargs)
    scorer = RewardScorer([RewardSpec("trl.rewards:get_soft_overlong_punishment", kwargs=kwargs)])
    scores = scorer.score(["p"] * 4, ["a"] * 4, {"completion_ids": ids})
    assert list(scores.per_function) == [theirs.__name__]
    assert scores.per_function[theirs.__name__].tolist() == pytest.approx(theirs(completion_ids=ids))
    named = RewardScorer([RewardSpec("trl.rewards:get_soft_overlong_punishment", kwargs=kwargs, name="overlong")])
    assert list(named.score(["p"] * 4, ["a"] * 4, {"completion_ids": ids}).per_function) == ["overlong"]
    with pytest.raises(ValueError, match=r"reward 'makes_nothing' takes nothing but its kwargs \(scale\), so it cannot see a completion"):
        RewardScorer([RewardSpec(makes_nothing, kwargs={"scale": 2.0})])
    with pytest.raises(ValueError, match=r"reward 'refuses_its_limit' .* calling it with its kwargs \(limit\) failed: ValueError: limit must be > 0"):
        RewardScorer([RewardSpec(refuses_its_limit, kwargs={"limit": 0})])
    # A reward whose batch argument is given as a kwarg is not called as a factory: the kwarg is what is wrong.
    with pytest.raises(ValueError, match="reward 'counts_calls': kwarg 'completions' would replace the batch's completions"):
        RewardScorer([RewardSpec(counts_calls, kwargs={"completions": ["x"]})])
    assert CALLS == []



def test_a_factory_whose_other_arguments_have_defaults_is_the_reward_it_returns():
    """TRL's get_repetition_penalty_reward() takes only defaulted arguments: named without kwargs, or with some, it
    was called as the reward at the first step (after a whole generation) and its function returned. A function of a
    data column with a default stays the reward."""
    from trl.rewards import get_repetition_penalty_reward

    ids = [[1, 2, 1, 2, 1, 2, 1, 2], [1, 2, 3, 4, 5, 6, 7, 8]]
    for kwargs in ({}, {"ngram_size": 2}):
        theirs = get_repetition_penalty_reward(**kwargs)
        scores = RewardScorer([RewardSpec("trl.rewards:get_repetition_penalty_reward", kwargs=kwargs)]).score(["p"] * 2, ["a"] * 2, {"completion_ids": ids})
        assert list(scores.per_function) == [theirs.__name__]
        assert scores.per_function[theirs.__name__].tolist() == pytest.approx(theirs(completion_ids=ids))
    column = RewardScorer([RewardSpec(scores_a_column)]).score(["p"] * 2, ["a"] * 2, {"answer": ["5", "6"]})
    assert column.per_function["scores_a_column"].tolist() == [1.0, 0.0]
    # Its kwargs refused by it: said before training, as TRL's call says it (it failed on every sample at the first step).
    with pytest.raises(ValueError, match=r"reward 'get_repetition_penalty_reward' takes no argument a reward is called with .* calling it "
                                         r"with its kwargs \(max_penalty\) failed: ValueError: max_penalty 1.0 should not be positive"):
        RewardScorer([RewardSpec("trl.rewards:get_repetition_penalty_reward", kwargs={"max_penalty": 1.0})])
    annotated = RewardScorer([RewardSpec(scores_a_column_annotated)])  # said to return its scores: never called to find out
    assert annotated.score(["p"] * 2, ["a"] * 2, {"answer": ["5", "6"]}).per_function["scores_a_column_annotated"].tolist() == [1.0, 0.0]
    assert ANNOTATED_CALLS == [["5", "6"]]


def test_a_rewards_fixed_kwargs_keep_what_the_recipe_wrote():
    """A quoted string stays a string: typed Any, the recipe parser read '[0-9]' (a regular expression) again as YAML,
    a list; numbers, booleans, null and nested values keep their own types."""
    from lightning_rl.launch.recipe_view import RecipeView
    from support.paths import REPO

    kwargs = '{pattern: "[0-9]", n: 3, x: 0.5, flag: true, s: "7", none: null, nested: {k: "[1]", l: [1, "null"]}}'
    # A reward that takes any keyword (`**_`): the run's own check of its kwargs against its signature passes.
    view = RecipeView.parse(REPO / "recipes" / "tiny" / "grpo.yaml", [f"--model.rewards=[{{function: test_rewards:length_bonus, kwargs: {kwargs}}}]"])
    (reward,) = view.get("model.rewards")
    assert reward["kwargs"] == {"pattern": "[0-9]", "n": 3, "x": 0.5, "flag": True, "s": "7", "none": None,
                                "nested": {"k": "[1]", "l": [1, "null"]}}  # fmt: skip


ANSWERS_SEEN: list = []


def records_answers(completions, answer):  # `answer` has no default: the rows without one give None, as in TRL
    ANSWERS_SEEN.extend(answer)
    return [0.0 if a is None else float(len(c)) for c, a in zip(completions, answer)]


def test_a_column_some_rows_lack_reaches_the_reward_as_none_for_those_rows(tmp_path):
    """TRL's dataset gives a column's missing values as None: so do the rows here, to a parameter without a default
    too (it was refused at the start, while the README's table said None)."""
    import lightning as L

    from lightning_rl.data.prompts import PromptDataModule
    from lightning_rl.modules.grpo import GRPOModule
    from support.grpo import FAST

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in (
        {"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?"}, {"prompt": "4+4?"})))
    ANSWERS_SEEN.clear()
    module = GRPOModule(**{**FAST, "rewards": [RewardSpec("test_rewards:records_answers"), RewardSpec("math_answer")]})
    L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(module, PromptDataModule(path=str(data), batch_size=2))  # fmt: skip
    assert sorted(ANSWERS_SEEN, key=str) == ["2"] * 4 + ["4"] * 4 + [None] * 8  # each row's 4 samples, one epoch


def abandons(completions, **_):
    from lightning_rl.stopping import StepAbandoned

    raise StepAbandoned("the run is stopping")


def test_a_step_abandoned_while_rewards_score_leaves_no_task_behind(caplog):
    """A stop while a step waits on its rewards is one closing line: asyncio said 'Task exception was never retrieved'
    with a traceback, the SystemExit having left its loop before the task's end was read."""
    import gc

    from lightning_rl.stopping import StepAbandoned

    scorer = RewardScorer([RewardSpec("test_rewards:abandons"), RewardSpec("test_rewards:length_bonus")])
    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(StepAbandoned):
        scorer.score(["p"], ["c"], {})
    gc.collect()  # where an unread task's exception is reported
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def needs_the_main_thread(completions, **_):
    """A reward with signal.alarm timeouts, as math_verify's parse and verify have: signal.signal raises off the main
    thread."""
    signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
    return [float(len(c)) for c in completions]


def test_a_reward_that_needs_the_main_thread_runs_there_as_in_trl_or_is_refused_in_one_line(caplog):
    """math_verify's rewards (the usual GRPO accuracy reward) failed on every sample: plain functions run on a thread
    of their own. One failing so is called on the main thread from then on, where the step scores on it."""
    scorer = RewardScorer([RewardSpec(needs_the_main_thread)])
    with caplog.at_level(logging.WARNING):
        first = scorer.score(["p"] * 2, ["ab", "abc"], {})
        second = scorer.score(["p"] * 2, ["a", "abcd"], {})
    assert first.total.tolist() == [2.0, 3.0] and second.total.tolist() == [1.0, 4.0] and not first.errors
    assert caplog.text.count("needs the main thread (ValueError: signal only works in main thread") == 1
    raised = []
    elsewhere = threading.Thread(target=lambda: _record(raised, lambda: RewardScorer([RewardSpec(needs_the_main_thread)]).score(["p"], ["a"], {})))
    elsewhere.start()
    elsewhere.join()
    assert isinstance(raised[0], RewardContractError)
    assert "needs the main thread (ValueError: signal only works in main thread" in str(raised[0]) and "async_mode: false" in str(raised[0])


def picky_about_alarms(completions, **_):
    if "bad" in completions:
        raise ValueError("bad input: no signal.alarm here")  # the words, on the main thread too: its own failure
    return [1.0] * len(completions)


def test_a_reward_failing_alike_on_the_main_thread_is_an_ordinary_failure_of_its_samples():
    scorer = RewardScorer([RewardSpec(picky_about_alarms)], all_failed="zero")
    scores = scorer.score(["p"] * 2, ["bad", "good"], {})
    assert scores.total.tolist() == [0.0, 1.0] and [e.sample for e in scores.errors] == [0]
    assert scorer.score(["p"], ["good"], {}).total.tolist() == [1.0] and not scorer.rewards["picky_about_alarms"].on_main_thread


def _record(into: list, call) -> None:
    try:
        call()
    except Exception as error:
        into.append(error)


async def _length_later(completion: str) -> float:
    await asyncio.sleep(0)
    return float(len(completion))


def runs_its_own_coroutines(completions, **_):
    """A sync wrapper around async code, as rewards written before async rewards are: on TRL's main thread
    asyncio.get_event_loop() gives a loop; on a reward's own thread there was none."""
    return asyncio.get_event_loop().run_until_complete(asyncio.gather(*(_length_later(c) for c in completions)))


def test_a_plain_reward_that_runs_its_own_coroutines_scores_as_on_trls_main_thread():
    assert RewardScorer([RewardSpec(runs_its_own_coroutines)]).score(["p"] * 2, ["a", "bb"], {}).total.tolist() == [1.0, 2.0]
