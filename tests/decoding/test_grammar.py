"""guided_grammar: a GBNF grammar as a regex, checked against Python's `re` on texts the grammar does and does not
derive; recursion that only repeats is unbounded, other recursion nests MAX_NESTING deep; bad grammars are refused
naming guided_grammar and where."""

import re

import pytest

from medusa.decoding.grammar import MAX_NESTING, REGEX_NESTING, grammar_dfa, grammar_regex
from medusa.decoding.regex_dfa import compile_regex
from medusa.decoding.sampling_params import SamplingParams

SQL = r'''
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "   # a comment
condition ::= column "= " number
number ::= "1 " | "2 "
'''

JSON = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''


def matches(grammar: str, text: str, nesting: int = REGEX_NESTING) -> bool:
    """Whether the grammar's regex matches the whole text, which its DFA (the guide's, made from the rules as
    terms) and the regex's own DFA must agree with, all unrolled `nesting` deep."""
    pattern = grammar_regex(grammar, nesting)
    whole = re.fullmatch(pattern, text) is not None
    for dfa in (grammar_dfa(grammar, nesting), compile_regex(pattern)):
        assert dfa.accepts(dfa.walk(dfa.start, text)) == whole, (type(dfa).__name__, text)
    return whole


@pytest.mark.parametrize("grammar,good,bad", [
    (SQL, ["SELECT col_1  from table_2  where col_2 = 1 "], ["SELECT col_3  from table_2  where col_2 = 1 ",
                                                             "SELECT col_1  from table_2  where col_2 = 1"]),
    (JSON, ['{"a": [1, {"b": "x\\n"}], "c": true}', "{}", '{"k": -0.5e3 }'], ['{"a": }', "[1]", '{"a": 01}']),
    ('root ::= [a-c\\-]+ "." [^a-z]', ["a-b.X", "-.\n"], ["ab.c", "d.X"]),  # an escaped dash is a dash
    ("root ::= 'it''s' | \"\\x41\\u00e9\" | \"\\U0001F600\"", ["its", "Aé", "\U0001F600"], ["it's"]),
    ('root ::= . "|" .', ["\n|x", "é|é"], ["ab|c"]),  # "." is any character, newlines too
    ('root ::= "a"{2} "b"{1,} "c"{0,2} ("d" "e"?){2,3}', ["aabdd", "aabbbccdede", "aabdedd"], ["abdd", "aabdddd"]),
    ('root ::= ("+" | "-")? digits\ndigits ::= [0-9] digits | [0-9]', ["-12", "7", "1" * 200], ["+", "1-"]),
    ('root ::= list\nlist ::= list "," item | item\nitem ::= [a-z]+', [",".join("ab" * 60)], [",a", "a,"]),
    ('root ::= ""', [""], ["a"]),
])
def test_the_regex_matches_what_the_grammar_derives(grammar, good, bad):
    for text in good:
        assert matches(grammar, text), text
    for text in bad:
        assert not matches(grammar, text), text


def test_recursion_is_followed_as_deep_as_the_text_goes_and_unrolled_where_asked():
    grammar = 'root ::= value\nvalue ::= "[" value "]" | "x"'
    for nesting in (2, REGEX_NESTING, 6):  # unrolled: the regex and the bounded term DFA nest `nesting` deep
        for depth in range(nesting + 2):
            text = "[" * depth + "x" + "]" * depth
            assert matches(grammar, text, nesting) == (depth < nesting), (nesting, depth)
    guide = grammar_dfa(grammar)  # the guide's: exact, rules expanded as the derivatives reach them
    for depth in (0, 1, 5, 40):
        text = "[" * depth + "x" + "]" * depth
        assert accepts(guide, text) and not accepts(guide, text + "]") and not accepts(guide, "[" + text)
    mutual = 'root ::= a\na ::= "(" b ")" | "a"\nb ::= "<" a ">" | "b"'
    assert matches(mutual, "(<(b)>)") and matches(mutual, "a") and not matches(mutual, "(a)")
    assert accepts(grammar_dfa(mutual), "(<" * 20 + "a" + ">)" * 20)


def accepts(dfa, text: str) -> bool:
    return dfa.accepts(dfa.walk(dfa.start, text))


def test_a_rule_that_reaches_itself_before_reading_is_unrolled_and_one_that_never_ends_is_left_out():
    indirect = 'root ::= a\na ::= b "x" | "y"\nb ::= a "z"'  # a -> b -> a, no character read between
    guide = grammar_dfa(indirect)
    assert guide.pattern.startswith(f"guided_grammar:{MAX_NESTING}:") and accepts(guide, "yzx")
    assert accepts(guide, "y" + "zx" * (MAX_NESTING - 1)) and not accepts(guide, "y" + "zx" * MAX_NESTING)
    pruned = grammar_dfa('root ::= "a" | "b" loop\nloop ::= "c" loop')  # loop never ends: "b" leads nowhere
    assert accepts(pruned, "a") and pruned.walk(pruned.start, "b") == -1
    with pytest.raises(ValueError, match="guided_grammar: it can never end"):
        grammar_dfa('root ::= "a" root')


def test_the_sql_example_of_vllms_docs_becomes_a_small_pattern():
    assert len(grammar_regex(SQL)) < 200 and len(grammar_regex(JSON)) < 200_000


@pytest.mark.parametrize("grammar,message", [
    ("", "must be a non-empty GBNF grammar"),
    ('answer ::= "a"', "has no root rule"),
    ("root ::= answer", "rule 'root' refers to 'answer', which is not defined"),
    ('root ::= "a"\nroot ::= "b"', "rule 'root' is defined twice at line 2, column 1"),
    ('start: "a" | "b"', "Lark grammars are not supported"),
    ('root ::= "a\\q"', r"unknown escape \\q"),
    ('root ::= ("a" | "b"', "missing \\) at line 1"),
    ('root ::= "a" )', "unexpected '\\)' at line 1, column 14"),
    ("root ::= [z-a]", "runs backwards"),
    ('root ::= "a"{3,2}', "maximum below its minimum"),
    ('root ::= @', "unexpected '@' at line 1, column 10"),
    ('root ::= root "a"', "root cannot end within"),
    ('root ::= "\\x4"', r"\\x needs 2 hex digits"),
])
def test_grammars_it_cannot_follow_are_refused_naming_guided_grammar(grammar, message):
    with pytest.raises(ValueError, match="guided_grammar.*" + message):
        grammar_regex(grammar)


def test_a_grammar_that_unrolls_too_wide_is_refused():
    wide = "root ::= e\ne ::= " + " | ".join(f'"{c}" e e e e' for c in "abcdefghij") + ' | "x"'
    with pytest.raises(ValueError, match="unrolls to a pattern over"):
        grammar_regex(wide)


def test_sampling_params_follow_the_grammar():
    params = SamplingParams(guided_grammar=SQL)
    assert params.guide_dfa() is grammar_dfa(SQL) and params.has_penalties and params.guides == ["guided_grammar"]
    with pytest.raises(ValueError, match="guided_grammar and guided_regex cannot both be set"):
        SamplingParams(guided_grammar=SQL, guided_regex="a")
    with pytest.raises(ValueError, match="guided_grammar ends the output with EOS"):
        SamplingParams(guided_grammar=SQL, min_tokens=2)
    with pytest.raises(ValueError, match="guided_grammar: rule 'root' refers to 'x'"):
        SamplingParams(guided_grammar="root ::= x")


def test_a_grammar_follows_its_rules_as_shared_terms_not_its_pattern(monkeypatch):
    """A grammar's DFA is made from its rules (each rule's term once, however often used), so the JSON grammar's
    100,000-character pattern is never compiled, and it nests as deep as the text goes."""
    import medusa.decoding.regex_dfa as regex_dfa

    compiled = []
    monkeypatch.setattr(regex_dfa, "CharDFA", lambda pattern: compiled.append(pattern))
    dfa = SamplingParams(guided_grammar=JSON).guide_dfa()
    assert compiled == [] and dfa.pattern == f"guided_grammar:{JSON}" and len(dfa.terms.nodes) < 300
    deep = '{"a": ' * 30 + "[1, " * 30 + "2" + "]" * 30 + "}" * 30
    for text, valid in [('{"a": [1, {"b": "x\\n"}], "c": true}', True), ("{}", True), ('{"a": }', False),
                        ("[1]", False), (deep, True), (deep + "}", False), (deep[:-1], False)]:
        assert accepts(dfa, text) == valid, text


@pytest.mark.parametrize("field", ["guided_regex", "guided_grammar"])
def test_a_guide_that_is_not_a_string_is_refused_naming_it(field):
    for value in ([], 5, ""):
        with pytest.raises(ValueError, match=f"{field} must be a non-empty string"):
            SamplingParams(**{field: value})


NESTED = 'root ::= list\nlist ::= list "," item | item\nitem ::= [a-c]+ | "[" list "]"'


@pytest.mark.parametrize("grammar", [SQL, JSON, NESTED, 'root ::= ("ab" | "a")* "b"? [^a]{0,3}'])
def test_the_term_dfa_and_the_regex_dfa_agree_on_every_prefix(grammar):
    """The guide asks whether a text can still become a match (not DEAD) and whether it is one: on random walks
    over the grammar's own characters, mostly ones that keep the text alive, the terms' DFA unrolled as deep as
    the regex answers as the regex's NFA-based one does, and the exact one as one unrolled deeper than the walk
    can nest."""
    import random

    from medusa.decoding.regex_dfa import DEAD

    rng = random.Random(0)
    alphabet = sorted(set(re.sub(r"[\s#].*", "", grammar) + ' "{}[],:0123456789abcSELECTtrue'))
    pairs = [(grammar_dfa(grammar, REGEX_NESTING), compile_regex(grammar_regex(grammar)), 40),
             (grammar_dfa(grammar), grammar_dfa(grammar, 24), 20)]
    for dfa, oracle, longest in pairs:
        for _ in range(150):
            a, b = dfa.start, oracle.start
            for _ in range(rng.randint(1, longest)):  # mostly characters that keep the text alive: walks go deep
                live = [c for c in alphabet if oracle.step(b, c) != DEAD]
                char = rng.choice(live if live and rng.random() < 0.9 else alphabet)
                a, b = dfa.step(a, char), oracle.step(b, char)
                assert (a == DEAD) == (b == DEAD) and dfa.accepts(a) == oracle.accepts(b)
                if a == DEAD:
                    break
