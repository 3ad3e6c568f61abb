import pytest

from snaketrl.config import ConfigError
from snaketrl.rewards import accuracy, format_match, keyword, prompt_overlap, resolve, rouge, unique_chars


def test_builtins_score_each_completion():
    assert unique_chars(["aab", "abc", ""]) == [2.0, 3.0, 0.0]
    assert unique_chars([[{"role": "assistant", "content": "xyz"}]]) == [3.0]
    assert format_match([" Sam sold my car.", "no end", "Two. Sentences here"]) == [1.0, 0.0, 0.0]
    assert keyword(["I feel fine", "nothing"], words=["feel", "fine"]) == [1.0, 0.0]
    post = "POST: My friend Sam sold my car. Now I feel sad.\n\nTL;DR:"
    assert prompt_overlap([" Sam sold my car.", " Alex sold my bike.", "", "!"], prompts=[post] * 4) == [
        1.0, 0.5, 0.0, 0.0]


def test_accuracy_compares_final_numbers():
    answers = ["Sam has 3 + 4 = <<3+4=7>>7.\n#### 7"] * 3
    assert accuracy(["so #### 7", "#### 8", "seven"], answer=answers) == [1.0, 0.0, 0.0]
    assert accuracy(["#### 1,234"], answer=["1234"]) == [1.0]


def test_resolve_names_modules_and_kwargs():
    funcs = resolve(["unique_chars", "operator:length_hint", {"function": "keyword", "kwargs": {"words": ["x"]}}])
    assert funcs[0] is unique_chars
    assert funcs[2](["x", "y"]) == [1.0, 0.0] and funcs[2].__name__ == "keyword"


def test_bad_names_are_clear():
    with pytest.raises(ConfigError, match=r"unknown reward function 'uniq'; expected a built-in"):
        resolve(["uniq"])
    with pytest.raises(ConfigError, match=r"cannot import 'nosuchmod:f'"):
        resolve(["nosuchmod:f"])


def test_flexible_accuracy_takes_the_last_number_of_prose():
    answers = ["x #### 22", "#### 1234", "#### 5"]
    completions = ["Jamie has 17 + 5 = 22 books.", "That makes 1,234.", "5 + 5 = 10"]
    assert accuracy(completions, answer=answers, match="flexible") == [1.0, 1.0, 0.0]
    assert accuracy(completions, answer=answers) == [0.0, 0.0, 0.0]  # strict: no ####
    assert accuracy([[{"role": "assistant", "content": "It is 22."}]], answer=["#### 22"], match="flexible") == [1.0]
    with pytest.raises(ConfigError, match="accuracy: match must be strict or flexible, got 'loose'"):
        accuracy(["1"], answer=["1"], match="loose")


def test_rouge_scores_f1_against_the_answer():
    tldr = ["Corporations are people, but they can't high-five."] * 4
    # rougeL: longest common subsequence of stemmed words, 6 of the completion's 7 and of the TL;DR's 9: F1 12/16.
    completions = ["Corporations are people but cannot high-five.", "I lost my keys.", "",
                   [{"role": "assistant", "content": "corporation people"}]]
    assert rouge(completions, answer=tldr) == [0.75, 0.0, 0.0, pytest.approx(4 / 11)]
    # rouge1: "cats sitting" shares one stem (cat) with "the cats sat": precision 1/2, recall 1/3.
    assert rouge(["the cat sat on the mat", "cats sitting"], answer=["The cat sat.", "the cats sat"],
                 kind="rouge1") == [2 / 3, pytest.approx(0.4)]
    assert rouge(["the cat sat on the mat"], answer=["The cat sat."], kind="rouge2") == [pytest.approx(4 / 7)]
    with pytest.raises(ConfigError, match="rouge: kind must be one of rouge1, rouge2, rougeL, got 'rougeLsum'"):
        rouge(["a"], answer=["a"], kind="rougeLsum")
    assert resolve([{"function": "rouge", "kwargs": {"kind": "rouge1"}}])[0](["a b"], answer=["a"]) == [2 / 3]
