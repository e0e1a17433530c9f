"""benchmarks/text_large.py: WordNet gloss/lemma extraction and the cbow_large goal row."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("text_large", REPO / "benchmarks" / "text_large.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tl = _module()

# WordNet data.* format: licence lines start with two spaces; a synset line ends in "| gloss".
DATA = "".join(line + "  \n" for line in [  # WordNet's lines end in two spaces
    "  1 This software and database is being provided to you, the LICENSEE, by",
    "  2 Princeton University under the following license.  |  not a gloss",
    "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived or known or inferred to have "
    "its own distinct existence (living or nonliving)",
    "00001930 03 n 01 physical_entity 0 001 @ 00001740 n 0000 | an entity that has physical existence",
    "00002000 03 n 01 odd 0 000 |",
    "00002137 03 n 02 abstraction 0 abstract_entity 0 001 @ 00001740 n 0000 | a general concept formed by "
    'extracting common features; "a | in the gloss stays"',
])

# WordNet index.* format: lemma pos synset_cnt p_cnt [ptr...] sense_cnt tagsense_cnt offsets
INDEX = """\
  1 licence line
dog n 7 5 @ ~ #m #p %p 7 42 02084071 10114209 10023039 09886220 09909760 02712903 03907626
physical_entity n 1 2 @ ~ 1 0 00001930
cat n 8 3 @ ~ %p 8 18 02121620 02985606 10162991 09900153 03608870 04519153 03498962 02983507
zebra n 1 2 @ ~ 1 0 02391049
aardvark n 1 1 @ 1 0 02063224
"""


def test_wordnet_glosses_take_text_after_the_first_bar():
    glosses = list(tl.wordnet_glosses(DATA.splitlines(keepends=True)))
    assert glosses == [
        "that which is perceived or known or inferred to have its own distinct existence (living or nonliving)",
        "an entity that has physical existence",
        'a general concept formed by extracting common features; "a | in the gloss stays"',
    ]


def test_wordnet_lemmas_keep_one_token_lemmas_and_order_by_tagged_senses():
    lemmas = tl.wordnet_lemmas(INDEX.splitlines())
    assert lemmas == {"dog": (42, 7), "cat": (18, 8), "zebra": (0, 1), "aardvark": (0, 1)}
    # a second part of speech adds up
    more = tl.wordnet_lemmas(["dog v 3 1 @ 3 2 01234567 01234568 01234569"])
    assert more == {"dog": (2, 3)}
    assert tl.order_lemmas(lemmas) == ["dog", "cat", "aardvark", "zebra"]


def test_corpus_stats_uses_the_converter_tokens():
    stats = tl.corpus_stats(["The dog's bone_marrow", "dog DOG 42"])
    assert stats == {"lines": 2, "tokens": 8, "vocabulary": 6}  # the dog s bone marrow / dog dog 42


def _point(mode, eps, loss, selection=None, seed=0):
    return {"mode": mode, "selection": selection, "target_epsilon": eps, "seed": seed,
            "test_metrics": {"loss": loss}, "rows_selected_mean": 100000.0 if mode == "dpsgd" else 900.0,
            "noise_multiplier": 0.5, "wall_s": 10.0, "lr": 3.0, "steps": 200}


def _doc(points):
    return {"corpus": {"packages": {"wordnet-base": "1:3.0-37"}, "corpus": {"lines": 3, "tokens": 9, "vocabulary": 7}},
            "dataset": {"table_rows": 50000, "num_examples": 10, "vocabulary_words_in_corpus": 5},
            "vocabulary_method": "public", "points": points}


def test_results_section_goal_met():
    points = [_point("nonprivate", None, 3.0)]
    for eps in (1.0, 3.0, 8.0):
        points += [_point("dpsgd", eps, 6.0), _point("sparse", eps, 5.5, "fest-threshold"),
                   _point("sparse", eps, 5.7, "threshold"),
                   {**_point("sparse", eps, 5.0, "fest-threshold"), "variant": "privacy.k=3000"}]
    lines, goals = tl.results_section(_doc(points))
    assert len(goals) == 1
    goal, measured, status, _why = goals[0]
    assert goal == tl.GOAL
    assert status == "**met**"
    assert "ε=1: sparse (fest-threshold (privacy.k=3000)) 5.000 vs dpsgd 6.000" in measured
    assert any(line.startswith("| sparse | fest-threshold | 1 | 1 |") and "5.500" in line for line in lines)
    assert any(line.startswith("| dpsgd | — | 8 | 1 | 3 | 200 | 6.000 | — | 100,000 |") for line in lines)


def test_results_section_goal_missed_when_sparse_loses_or_a_pair_is_missing():
    points = [_point("dpsgd", 1.0, 6.0), _point("sparse", 1.0, 5.0, "fest-threshold"),
              _point("dpsgd", 3.0, 5.0), _point("sparse", 3.0, 4.9, "fest-threshold"),
              _point("dpsgd", 8.0, 4.0), _point("sparse", 8.0, 4.5, "fest-threshold")]
    _, [(_, measured, status, why)] = tl.results_section(_doc(points))
    assert status == "**missed**" and "ε = 8" in why and "4.500 vs dpsgd 4.000" in measured

    points = [_point("dpsgd", 1.0, 6.0), _point("sparse", 1.0, 5.0, "fest-threshold"), _point("dpsgd", 3.0, 6.0),
              {"mode": "sparse", "selection": "fest-threshold", "target_epsilon": 3.0, "seed": 0, "error": "boom"}]
    lines, [(_, measured, status, why)] = tl.results_section(_doc(points))
    assert status == "**missed**" and "no pair at ε = 3, 8" in measured
    assert any("Failed points" in line for line in lines)
