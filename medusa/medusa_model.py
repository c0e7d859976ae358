"""The public face: `MedusaModel.from_pretrained(...).generate(...)`.

It ties together the base model, its heads, a tokenizer and a tree, turns user
input (text, chat messages or token ids) into ids, and drives the decoder.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from medusa.adapter import heads_for_base
from medusa.chat import chat_prompt_ids
from medusa.decoding.detokenizer import IncrementalDetokenizer
from medusa.decoding.engine import EngineConfig, LLMEngine, stream
from medusa.decoding.engine_request import is_token_id
from medusa.decoding.generator import TreeDecoder
from medusa.decoding.sampler import SamplingConfig
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.speculation_gate import SpeculationGate
from medusa.decoding.tree_select import choose_tree
from medusa.decoding.verifier import AcceptanceConfig
from medusa.heads import MedusaHeads
from medusa.loading import default_dtype, load_base_model, resolve_device
from medusa.model import DecoderModel
from medusa.tree import TreeSpec


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    accepted_lengths: list[int]  # tokens emitted by each verification step
    tokens_per_second: float

    @property
    def steps(self) -> int:
        return len(self.accepted_lengths)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step emitted: the end-of-sequence token a step wrote counts (it is not in
        token_ids), so a step is never worth less than 1."""
        return sum(self.accepted_lengths) / max(self.steps, 1)


def written_lengths(step_lengths: list[int], written: int) -> list[int]:
    """Each verification step's tokens in the answer. A last step may verify tokens past max_new_tokens or a stop:
    they are not written, so they are cut and the lengths sum to `written` (the answer's tokens, plus the EOS or
    stop token that ended it: a step did emit that one)."""
    lengths, left = [], written
    for n in step_lengths:
        if left <= 0:
            break
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def _engine_written(out) -> int:
    """The tokens an engine output's verification steps wrote: its tokens, less the first (the prefill's), plus the
    stop token that ended it (EOS or a stop_token_id; not in token_ids)."""
    ended_on_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
    return max(len(out.token_ids) + ended_on_token - 1, 0)


class GenerationStream:
    """Iterate for text deltas as tokens are accepted; `.result` once it is exhausted."""

    def __init__(self, chunks: Iterator[str]) -> None:
        self._chunks = chunks
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        result = yield from self._chunks
        if result is not None:  # iterated again once exhausted: nothing more comes, the result stays
            self.result = result


# Prompt-lookup nodes in speculative trees on a GPU unless the caller says otherwise: on the H200, 4 took
# the shipped heads from 1.78 to 2.82 tokens per step on all of Spec-Bench (1.48x -> 2.33x; RESULTS.md,
# E4), and with 16-token steps 8 took them from 2.97 to 3.46 tokens on 65 questions (1.81x -> 2.07x its
# plain decoding; 6: 1.97x, 12: 2.08x) and to 3.30 tokens, 1.995x, on all 480 (RESULTS.md, session 20; 3.15
# tokens, 1.93x, in session 21's lease, whose policy ran the 12-token tree most).
DEFAULT_PROMPT_LOOKUP = 8
# On a CPU every tree node costs about a token's compute, so the chain is shorter there. Through the batch-1
# decoder (the tree timed at load, the speculation gate) on 26 Spec-Bench questions, 2 per category, 128
# tokens, 2 cores, float32: 4 nodes 1.27x plain decoding, 8 nodes 1.21x, none 1.07x, and 4 was no slower than
# plain in any category (RESULTS.md, session 28). Before the CPU's large-weight products ran swapped
# (session 27) a chain had made a chat prompt slower (0.85x -> 0.61x).
CPU_PROMPT_LOOKUP = 4


def default_prompt_lookup(device: torch.device) -> int:
    return DEFAULT_PROMPT_LOOKUP if torch.device(device).type == "cuda" else CPU_PROMPT_LOOKUP


# Tokens a step of each searched candidate tree carries, lookup chain included. On an H200 a step of the
# default model cost the same at 12 and 16 tokens (0.698 and 0.694 ms, one 16-row tensor-core tile; RESULTS.md,
# session 19) and more past 16 (the products leave the tile), so one candidate fills 16 exactly.
STEP_TOKENS = (8, 12, 16, 32)

WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """torch.bfloat16 or "bfloat16" (as Hugging Face's torch_dtype takes it); None or "auto": the device's default."""
    if dtype is None or dtype == "auto":
        return None
    resolved = WEIGHT_DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if resolved not in WEIGHT_DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)} (or 'auto'), got {dtype!r}")
    return resolved


def _named_tree(tree: TreeSpec | str | Path | None) -> TreeSpec | str | None:
    """A tree name or JSON file's path -> its TreeSpec (an unknown name raises, listing the known ones); "auto",
    None and specs as given; anything else is refused."""
    if tree is None or isinstance(tree, TreeSpec) or (isinstance(tree, str) and tree == "auto"):
        return tree
    if isinstance(tree, (str, Path)):
        return TreeSpec.load(tree)
    raise ValueError(f"tree must be a tree's name (say 'tree-16'), a JSON file's path, 'auto' or a TreeSpec, "
                     f"got {tree!r}")


class MedusaModel:
    def __init__(self, base: DecoderModel, tokenizer: Any, heads: MedusaHeads | None = None,
                 tree: TreeSpec | str | None = None, system_prompt: str | None = None,
                 prompt_lookup: int | None = None) -> None:
        self.base, self.tokenizer, self.heads = base, tokenizer, heads
        self.system_prompt = system_prompt
        self.merged_adapter: Path | None = None  # the Medusa-2 LoRA folded into base at load, if any
        if prompt_lookup is None:
            prompt_lookup = default_prompt_lookup(base.embed_tokens.weight.device)
        EngineConfig(prompt_lookup=prompt_lookup)  # refuse a bad value now, not at the first engine
        self.prompt_lookup = prompt_lookup  # the engine's EngineConfig.prompt_lookup
        self.eos_token_ids = _eos_ids(base, tokenizer)
        self._tree_choice = _named_tree(tree)  # an unknown name fails here, not at the first generate()
        if heads is not None and isinstance(self._tree_choice, TreeSpec):  # so does one the heads cannot fill
            self._tree_choice.check_heads(heads.config.num_heads, heads.config.vocab_size)
        self._auto_choice: TreeSpec | None = None  # the tree choose_tree measured, once it has
        self._decoders: dict[tuple[TreeSpec, bool], TreeDecoder] = {}
        self._engines: dict[bool, LLMEngine] = {}

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, heads: str | Path | MedusaHeads | None = None,
                        tree: TreeSpec | str | None = None, dtype: torch.dtype | str | None = None,
                        device: str | torch.device | None = None,
                        prompt_lookup: int | None = None) -> "MedusaModel":
        """A checkpoint folder or .gguf (None: the default model) with its heads.

        heads: a heads folder/file in our, FasterDecoding's or TGI's format, a
        MedusaHeads, None (the default model's shipped heads; no heads, i.e.
        plain decoding, for any other model), or "none" (no heads, as the CLI's
        --heads none). tree: a TreeSpec, a named tree, or "auto" / None (the tree of most tokens a second, from step costs measured
        on this device at the first generate()). dtype: torch.bfloat16 or its
        name, None: bfloat16 on a GPU, float32 on a CPU. device: None picks a
        GPU if torch sees one. prompt_lookup: L > 0 adds L prompt-lookup nodes
        (n-gram copies of earlier text) to speculative trees; None: 8 on a GPU,
        4 on a CPU (see DEFAULT_PROMPT_LOOKUP); 0: the heads alone. Outputs are
        unchanged either way.
        """
        from medusa import default_model

        if heads is not None and not isinstance(heads, (str, Path, MedusaHeads)):  # before the weights load
            raise TypeError(f"heads must be a heads folder or file, a MedusaHeads or None, got {type(heads).__name__}")
        device = resolve_device(device)
        dtype = _resolve_dtype(dtype) or default_dtype(device)
        tree = _named_tree(tree)  # a bad name fails before the weights load
        system_prompt = None
        no_heads = heads == "none"
        if path is None:
            path, system_prompt = default_model.default_model_path(), default_model.DEFAULT_SYSTEM_PROMPT
            if heads is None:
                heads = default_model.default_heads_path()
        if no_heads:
            heads = None
        base = load_base_model(path, dtype=dtype, device=device)
        tokenizer = _load_tokenizer(path)
        adapter = None
        if isinstance(heads, (str, Path)):  # Medusa-2 heads merge the LoRA they were trained with into the base
            folder = Path(heads)
            heads, merged = heads_for_base(base, folder, dtype=dtype, device=device)
            adapter = folder if merged else None
        if isinstance(heads, MedusaHeads):
            _check_heads_fit(heads, base)
            heads = heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
        model = cls(base, tokenizer, heads, tree, system_prompt, prompt_lookup)
        model.merged_adapter = adapter
        return model

    # ---- generation -------------------------------------------------------

    def generate(self, inputs: str | Sequence[dict] | Sequence[int] | torch.Tensor | Sequence[str],
                 max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: str | Sequence[str] | None = None, stream: bool = False,
                 speculative: bool = True, tree: TreeSpec | str | None = None, acceptance: str = "auto",
                 posterior_threshold: float = 0.09, posterior_alpha: float = 0.3, min_p: float = 0.0,
                 guided_regex: str | None = None, guided_json: dict | str | None = None,
                 guided_choice: Sequence[str] | None = None, guided_grammar: str | None = None,
                 do_sample: bool | None = None, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, stop_token_ids: Sequence[int] | None = None, min_tokens: int = 0):
        """Generate from a prompt string, chat messages, or token ids.

        Greedy (temperature 0) output is identical to plain greedy decoding;
        sampling is lossless unless acceptance="typical". A list of prompts
        (strings, conversations or token-id lists) runs as one batch on the
        engine and returns a list of results. With stream=True, returns a
        GenerationStream of text deltas. guided_regex / guided_json (a JSON
        Schema) / guided_grammar (GBNF) / guided_choice hold the answer to a
        pattern, a schema, a grammar or one of the strings (vLLM's; on the
        engine, whatever the device). do_sample is Hugging Face's: False is
        greedy whatever the temperature, True samples (at temperature 1 if none
        is given). The penalties, stop_token_ids and min_tokens are vLLM's
        (SamplingParams'); like guided decoding they run on the engine.
        """
        for name, value in (("stream", stream), ("speculative", speculative)):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        tree = _named_tree(tree)
        if do_sample is not None:  # Hugging Face's switch: off is greedy; on with no temperature samples at 1
            if not isinstance(do_sample, (bool, np.bool_)):
                raise ValueError(f"do_sample must be a bool or None, got {do_sample!r}")
            temperature = (temperature or 1.0) if do_sample else 0.0
        # every path's settings checked here, by generate's names (the batch-1 decoder runs on them too)
        checked = generate_params(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  seed=seed, stop=stop, min_p=min_p, guided_regex=guided_regex,
                                  guided_json=guided_json, guided_choice=guided_choice, guided_grammar=guided_grammar,
                                  repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                  frequency_penalty=frequency_penalty, stop_token_ids=stop_token_ids,
                                  min_tokens=min_tokens)
        if _is_prompt_list(inputs):
            if stream or tree is not None or acceptance != "auto":
                raise ValueError("a list of prompts runs on the batching engine, which streams per request, picks "
                                 "its own tree per step and uses the lossless rule: pass one prompt for "
                                 "stream=, tree= or acceptance=")
            return self._generate_batch(list(inputs), checked, speculative)
        engine_only = _engine_only_settings(checked)
        if engine_only and (tree is not None or acceptance != "auto"):
            raise ValueError(f"{engine_only} runs on the batching engine, which picks its own tree per step and "
                             "uses the lossless rule: leave tree= and acceptance= out")
        prompt_ids = self.encode(inputs)
        if engine_only or self._on_engine(tree, acceptance):
            chunks = self._run_engine(prompt_ids, checked, speculative)
            return _finish(chunks, stream)
        sampling = SamplingConfig(temperature=checked.temperature, top_p=checked.top_p, top_k=checked.top_k,
                                  seed=checked.seed, min_p=checked.min_p)
        accept = AcceptanceConfig(rule=acceptance, posterior_threshold=posterior_threshold,
                                  posterior_alpha=posterior_alpha)
        decoder = self.decoder(tree if speculative else "single")
        return _finish(self._run(decoder, prompt_ids, max_new_tokens, sampling, accept, list(checked.stop)), stream)

    def _on_engine(self, tree: TreeSpec | str | None, acceptance: str) -> bool:
        """On a GPU, one prompt runs alone on the engine (CUDA graphs, trees chosen from measured
        step times) unless the caller pinned a tree or the typical acceptance rule."""
        return self.base.embed_tokens.weight.is_cuda and not self._pinned(tree) and acceptance == "auto"

    def _pinned(self, tree: TreeSpec | str | None) -> bool:
        """Whether a tree was named, here or at load time. The tree `choose_tree` measured (which
        `resolve_tree` caches, and the CLI passes back) is no one's pin."""
        def named(choice) -> bool:
            return choice not in (None, "auto") and choice is not self._auto_choice
        return named(tree) or named(self._tree_choice)

    def _run_engine(self, prompt_ids: list[int], params: SamplingParams, speculative: bool):
        start = time.perf_counter()
        last = None
        for last in stream(self.engine(speculative), prompt_ids, params):  # aborts if the caller stops early
            if last.new_text:
                yield last.new_text
        seconds = time.perf_counter() - start
        return GenerationResult(text=last.text, token_ids=list(last.token_ids), finish_reason=last.finish_reason,
                                prompt_tokens=len(prompt_ids),
                                accepted_lengths=written_lengths(last.stats.accepted_lengths, _engine_written(last)),
                                tokens_per_second=len(last.token_ids) / max(seconds, 1e-9))

    def engine(self, speculative: bool = True) -> LLMEngine:
        """The continuous-batching engine over this model (built once per mode). On a CPU a Medusa engine
        is warmed up here (its trees timed: a few seconds, `eager_costs.py`); on a GPU `warmup()` is the
        caller's (graph captures take 20-30 s)."""
        key = speculative and self.heads is not None
        if key not in self._engines:
            engine = LLMEngine(self.base, self.heads if key else None, self.engine_config(), self.tokenizer,
                               sorted(self.eos_token_ids))
            if key and not self.base.embed_tokens.weight.is_cuda:
                engine.warmup()
            self._engines[key] = engine
        return self._engines[key]

    def searched_sizes(self) -> tuple[int, ...]:
        """Head nodes of the searched candidate trees: each fills a step of STEP_TOKENS tokens together
        with the prompt-lookup chain (a step of 16 tokens is one tensor-core tile, so it costs what one
        of 12 does)."""
        return tuple(tokens - self.prompt_lookup for tokens in STEP_TOKENS if tokens - self.prompt_lookup >= 2)

    def engine_config(self) -> EngineConfig:
        """Candidate trees for the engine: searched for the heads' measured accuracies
        when they carry them (the heads' own tree as the largest), else the named ones;
        each speculative one gets the model's prompt-lookup chain."""
        if self.heads is None:
            return EngineConfig(prompt_lookup=self.prompt_lookup)
        cfg = self.heads.config
        if cfg.accuracies:  # trees of as many nodes as few heads of short top-k lists hold
            capacity = sum(len(cfg.accuracies[0]) ** d for d in range(len(cfg.accuracies) + 1))
            small = tuple(TreeSpec.search(cfg.accuracies, n, name=f"searched-{n}") for n in self.searched_sizes()
                          if n <= capacity)
        else:
            small = tuple(map(TreeSpec.load, ("tree-4", "tree-8", "tree-16", "tree-32")))
        own = TreeSpec.from_paths([tuple(p) for p in cfg.tree], name="heads") if cfg.tree else None
        largest = own if own is not None and own.num_nodes <= 64 else TreeSpec.load("tree-64")
        fitting = tuple(t for t in small + (largest,) if t.head_depth <= cfg.num_heads)  # the engine refuses others
        return EngineConfig(trees=("single",) + fitting, prompt_lookup=self.prompt_lookup)

    def _generate_batch(self, prompts: list, params: SamplingParams, speculative: bool) -> list[GenerationResult]:
        ids = [self.encode(p) for p in prompts]
        start = time.perf_counter()
        outputs = self.engine(speculative).generate(ids, params)
        seconds = time.perf_counter() - start  # the batch's wall time: requests share it
        return [GenerationResult(text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason,
                                 prompt_tokens=len(p),
                                 accepted_lengths=written_lengths(o.stats.accepted_lengths, _engine_written(o)),
                                 tokens_per_second=len(o.token_ids) / max(seconds, 1e-9))
                for o, p in zip(outputs, ids)]

    def chat(self, messages: str | Sequence[dict] | Sequence[str] | Sequence[Sequence[dict]], **kwargs):
        """generate() on chat: a string is one user message, a list of message dicts one conversation; a list of
        strings or of conversations is a batch of them (a result each), as vLLM's `LLM.chat` takes it."""
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, str) for m in messages):
            return self.generate([_user_turn(m) for m in messages], **kwargs)
        return self.generate(_user_turn(messages) if isinstance(messages, str) else messages, **kwargs)

    def encode(self, inputs: str | Sequence[dict] | Sequence[int] | torch.Tensor) -> list[int]:
        """Token ids of a prompt: text with the tokenizer's own special tokens (a BOS where the model's tokenizer
        adds one, as Hugging Face's `tokenizer(text)` and vLLM do), a conversation through the chat template
        (which writes any BOS itself), or token ids as given (checked against the vocabulary)."""
        if isinstance(inputs, str):
            return self.tokenizer(inputs)["input_ids"]
        if isinstance(inputs, (torch.Tensor, np.ndarray)):
            if inputs.ndim > 1 and inputs.shape[0] != 1:
                raise ValueError(f"input_ids must be one sequence, got shape {tuple(inputs.shape)}")
            inputs = inputs.reshape(-1).tolist()
        if isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], dict):
            return chat_prompt_ids(self.tokenizer, inputs, self.system_prompt)
        if isinstance(inputs, (list, tuple)) and all(is_token_id(t) for t in inputs):
            inputs = [int(t) for t in inputs]  # NumPy's integers too
            vocab = self.base.config.vocab_size
            bad = [t for t in inputs if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return list(inputs)
        raise TypeError("inputs must be a prompt string, a list of chat messages, or a list of token ids")

    def decoder(self, tree: TreeSpec | str | None = None) -> TreeDecoder:
        """The decoder for a tree (cached per tree), a speculative one with the model's prompt-lookup
        chain; None means the model's default choice. The tree measured on this device ("auto")
        gets a `SpeculationGate`: greedy steps fall back to plain decoding where it is faster."""
        spec = self.resolve_tree(tree)
        gated = spec is self._auto_choice and spec.num_nodes > 1
        expected = self._expected_length(spec) if gated else 1.0  # the heads' part: a lookup chain adds more
        if self.prompt_lookup and spec.num_nodes > 1 and not spec.lookup:
            spec = spec.with_lookup(self.prompt_lookup)
        if (spec, gated) not in self._decoders:
            self._decoders[spec, gated] = TreeDecoder(self.base, self.heads if spec.num_nodes > 1 else None, spec,
                                                      gate=SpeculationGate(expected) if gated else None)
        return self._decoders[spec, gated]

    def _expected_length(self, spec: TreeSpec) -> float:
        """The tree's accepted length predicted from the heads' measured accuracies (1.0 without them)."""
        accuracies = self.heads.config.accuracies if self.heads is not None else None
        try:
            return spec.expected_accept_length(accuracies) if accuracies else 1.0
        except ValueError:  # accuracies that do not cover the tree's heads or ranks
            return 1.0

    def resolve_tree(self, tree: TreeSpec | str | None = None) -> TreeSpec:
        """Explicit argument, else the model's tree, else "auto" (measured on this device)."""
        choice = tree if tree is not None else self._tree_choice
        if self.heads is None:
            if _is_speculative(choice):
                warnings.warn("no Medusa heads loaded: decoding without speculation", stacklevel=3)
            return TreeSpec.load("single")
        if choice is None or choice == "auto":
            choice = choose_tree(self.base, self.heads)
            self._tree_choice = self._auto_choice = choice  # measure once per model
        return choice if isinstance(choice, TreeSpec) else TreeSpec.load(choice)

    def _run(self, decoder: TreeDecoder, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
             acceptance: AcceptanceConfig, stops: list[str]):
        detok = IncrementalDetokenizer(self.tokenizer, stops)
        finish = "length"
        emitted: list[int] = []
        ended_on_eos = False
        for tokens in decoder.decode(prompt_ids, max_new_tokens, sampling, acceptance):
            tokens = tokens[: max_new_tokens - len(emitted)]
            eos_at = next((i for i, t in enumerate(tokens) if t in self.eos_token_ids), None)
            if eos_at is not None:
                tokens, finish, ended_on_eos = tokens[:eos_at], "stop", True
            delta = ""
            for i, token in enumerate(tokens):  # one at a time: stop exactly at the stop string's token
                delta += detok.add([token])
                if detok.stopped:
                    tokens, finish, ended_on_eos = tokens[: i + 1], "stop", False
                    break
            emitted.extend(tokens)
            if delta:
                yield delta
            if finish == "stop" or len(emitted) >= max_new_tokens:
                break
        tail = detok.flush()
        if tail:
            yield tail
        stats = decoder.stats
        return GenerationResult(text=detok.text, token_ids=emitted, finish_reason=finish,
                                prompt_tokens=len(prompt_ids),
                                accepted_lengths=written_lengths(stats.accepted_lengths, len(emitted) + ended_on_eos),
                                tokens_per_second=len(emitted) / max(stats.prefill_seconds + stats.decode_seconds, 1e-9))


def _finish(chunks: Iterator[str], stream: bool):
    """A GenerationStream when streaming, else run it out and return its result."""
    stream_obj = GenerationStream(chunks)
    if stream:
        return stream_obj
    for _ in stream_obj:
        pass
    return stream_obj.result


def _is_speculative(tree: TreeSpec | str | None) -> bool:
    if isinstance(tree, TreeSpec):
        return tree.num_nodes > 1
    return tree not in (None, "single", "auto")


def generate_params(max_new_tokens: int = 256, stop: str | Sequence[str] | None = None,
                    guided_choice: Sequence[str] | None = None, **settings: Any) -> SamplingParams:
    """`MedusaModel.generate`'s settings as the engine's SamplingParams, which checks them all (types and
    ranges); its errors name the engine's max_tokens, which generate calls max_new_tokens. The CLI checks
    its options with this before it loads a model."""
    try:
        choices = guided_choice if isinstance(guided_choice, str) else tuple(guided_choice or ())
        return SamplingParams(max_tokens=max_new_tokens, stop=stop, guided_choice=choices, **settings)  # a str: refused
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("max_tokens", "max_new_tokens")) from None


def _user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _engine_only_settings(params: SamplingParams) -> str:
    """The settings only the engine applies, named as generate's arguments ("" if none is set): the batch-1
    decoder (a CPU's single prompt, or a pinned tree) knows none of them."""
    named = [("guided decoding", bool(params.guides)), ("repetition_penalty", params.repetition_penalty != 1),
             ("presence_penalty", params.presence_penalty != 0), ("frequency_penalty", params.frequency_penalty != 0),
             ("stop_token_ids", bool(params.stop_token_ids)), ("min_tokens", params.min_tokens > 0)]
    return ", ".join(name for name, on in named if on)


def _is_prompt_list(inputs: Any) -> bool:
    """Several prompts (each a string, a conversation or token ids), not one conversation or one id list."""
    def listed(p: Any, kind: type | None) -> bool:  # kind None: token ids
        return isinstance(p, (list, tuple)) and bool(p) and all(
            is_token_id(x) if kind is None else isinstance(x, kind) for x in p)

    return listed(inputs, object) and all(isinstance(p, str) or listed(p, dict) or listed(p, None) for p in inputs)


def _eos_ids(base: DecoderModel, tokenizer: Any) -> frozenset[int]:
    ids = set(base.config.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def _check_heads_fit(heads: MedusaHeads, base: DecoderModel) -> None:
    if heads.config.hidden_size != base.config.hidden_size or heads.config.vocab_size != base.config.vocab_size:
        raise ValueError(
            f"heads were built for hidden size {heads.config.hidden_size} and vocabulary {heads.config.vocab_size}, "
            f"but the base model has {base.config.hidden_size} and {base.config.vocab_size}"
        )
