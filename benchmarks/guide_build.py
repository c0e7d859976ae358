"""What a guided request's token guide costs to build, on the default tokenizer (host work, no model).

    python benchmarks/guide_build.py --out out/guide-build

For each case, a regex, a JSON Schema or a GBNF grammar, and a sample answer in it: the guide's construction
(its automaton as SamplingParams.guide_dfa makes it, then the guide), then the answer's tokens walked through
it the way the engine does, each state's allowed tokens made on first reach (`RegexGuide.allowed`), then the
same walk again with everything built. Also the vocabulary's trie (once per tokenizer) and the guide's memory.
Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.token_guide import RegexGuide, VocabTrie
from medusa.default_model import default_model_path

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
         "required": ["name", "age"]}
COUNTED = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 600},
                                            "confidence": {"enum": ["low", "medium", "high"]}},
           "required": ["answer", "confidence"]}
SQL = """root ::= "SELECT " columns " FROM " name (" WHERE " name " = " value)? ";"
columns ::= name | columns ", " name
name ::= [a-z_]+
value ::= [0-9]+ | "'" [^']* "'"
"""
JSON_GBNF = r"""root ::= object
value ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank, while birds sing. "
# (case, SamplingParams field, its value, a sample answer): each guide made as the engine makes it
CASES = [("phone regex", "guided_regex", r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"),
         ("small schema", "guided_json", SMALL, '{"name": "Felix the cat", "age": 12, "tags": ["cute", "fluffy"]}'),
         ("json_object", "guided_json", {"type": "object"},
          '{"name": "Felix", "info": {"age": 12, "likes": ["fish", "naps"]}, "ok": true}'),
         ("maxLength 600, 200-character answer", "guided_json", COUNTED,
          '{"answer": "' + SENTENCE * 2 + '", "confidence": "high"}'),
         (".*", "guided_regex", ".*", "hello world, it's me"),
         ("SQL grammar", "guided_grammar", SQL, "SELECT id, name FROM users WHERE name = 'Ann';"),
         ("JSON grammar (GBNF)", "guided_grammar", JSON_GBNF,
          '{"name": "Felix", "info": {"age": 12, "likes": ["fish", "naps"]}, "ok": true}')]


def walk(guide: RegexGuide, tokens: list[int]) -> tuple[float, float]:
    """Seconds to walk `tokens` (each state's mask made on first reach), and the slowest state."""
    state, slowest, start = guide.start, 0.0, time.perf_counter()
    for token in tokens:
        before = time.perf_counter()
        assert guide.allowed(state)[token], "the sample answer leaves the pattern"
        slowest = max(slowest, time.perf_counter() - before)
        state = guide.advance(state, token)
    assert guide.dfa.accepts(state), "the sample answer is not a whole match"
    return time.perf_counter() - start, slowest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()))
    start = time.perf_counter()
    trie = VocabTrie.of(tokenizer)
    result = {"trie_s": time.perf_counter() - start, "cases": []}
    print(f"vocabulary trie: {result['trie_s']:.2f} s")
    for name, field, spec, answer in CASES:
        start = time.perf_counter()
        dfa = SamplingParams(**{field: spec}).guide_dfa()  # a regex's over its NFA, a schema's or grammar's rules
        guide = RegexGuide(dfa, trie, [tokenizer.eos_token_id])
        build = time.perf_counter() - start
        tokens = tokenizer.encode(answer, add_special_tokens=False)
        first, slowest = walk(guide, tokens)
        again, _ = walk(guide, tokens)
        states = len(guide._next)
        row = {"case": name, "build_s": build, "tokens": len(tokens), "states": states, "first_walk_s": first,
               "slowest_state_s": slowest, "built_walk_s": again}
        if hasattr(guide, "_walk"):  # memory (the script also runs on older guides, for comparison)
            row["next_state_bytes"] = sum(a.nbytes for a in guide._next.values()) // max(states, 1)
            row["class_bytes"] = sum(column.nbytes for column in guide._walk.columns)
        result["cases"].append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
