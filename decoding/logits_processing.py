"""Per-request changes to the base logits before a verdict: the min_tokens EOS ban, logit bias, penalties and
token rules (bad words, guided choices and regexes).

Both work on every node of a tree at once: node i's logits predict output
number num_output_tokens + depth(i), after the text of node i's path. Logprobs
are always reported from the raw logits, before these changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F

from medusa.decoding.device_tree import DeviceTree
from medusa.decoding.host_buffers import to_device
from medusa.decoding.outputs import TokenLogprob
from medusa.decoding.sampling_params import SamplingParams
from medusa.decoding.token_guide import GuideProgress, RegexGuide
from medusa.kernels.row_changes import count_penalized


def suppress_eos(params: SamplingParams, produced: int, banned: Sequence[int], logits: torch.Tensor,
                 depths: torch.Tensor) -> torch.Tensor:
    """Before min_tokens outputs, EOS / stop tokens may not be chosen at any node.

    logits [N, V]; depths [N]: node i's target is output number
    produced + depths[i] (the pending root counts as output).
    """
    if params.ignore_eos or not banned or produced >= params.min_tokens:  # the root's depth is 0: no node is early
        return logits
    early = (produced + depths < params.min_tokens)[:, None]  # [N, 1], on the device: nothing is read back
    ids = to_device(list(banned), torch.long, logits.device)
    logits = logits.clone()
    logits[:, ids] = logits[:, ids].masked_fill(early, float("-inf"))
    return logits


@dataclass(frozen=True)
class TokenRules:
    """A request's rules over token sequences, from its params through the tokenizer (`engine_request.token_rules`):
    bad words, each a token sequence whose last token may not complete it; guided choices, the token sequences
    the output must be one of, then one of `ends` (EOS); a guide, the tokens that keep the output's text a prefix
    of a match of guided_regex, and `ends` once it matches."""

    bad_words: tuple[tuple[int, ...], ...] = ()
    choices: tuple[tuple[int, ...], ...] = ()
    ends: tuple[int, ...] = ()
    guide: GuideProgress | None = None  # guided_regex: a cursor in the pattern's token guide (one per sequence)

    def for_sequence(self) -> TokenRules:
        """The rules for one more sequence of the request (n > 1): its own guide cursor, the rest shared."""
        return self if self.guide is None else replace(self, guide=GuideProgress(self.guide.guide))


def penalize(params: SamplingParams, output_ids: Sequence[int], logits: torch.Tensor,
             tree: DeviceTree | None = None, candidates: torch.Tensor | None = None,
             prompt_ids: Sequence[int] = (), rules: TokenRules = TokenRules()) -> torch.Tensor:
    """logit_bias, allowed_token_ids and the token rules (bad words, guided choices, a guided regex), then the
    repetition penalty and OpenAI's presence / frequency penalties, at every tree node, each from its own text
    (vLLM's order and semantics).

    logits [N, V] at the nodes of `tree` (candidates [N], root first), or [1, V]
    at the last token with no tree. Row i predicts the token after node i, so
    its counts are those of the output so far (output_ids, which already ends
    with the pending root, node 0) plus node i's path below the root: every
    ancestor at depth >= 1 *and node i itself*, all of which precede the
    predicted token. Each node then sees exactly the logits plain decoding would
    see had it emitted that path, so greedy equals plain greedy and sampling
    stays lossless. Presence and frequency count the output only; the repetition
    penalty also every token of the prompt (`prompt_ids`). Returns float32 logits
    (a new tensor) when anything applies.
    """
    if not params.has_penalties:
        return logits
    num_nodes, vocab = logits.shape
    device = logits.device
    logits = logits.float().clone()
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        logits[:, to_device(ids, torch.long, device)] += to_device(bias, torch.float32, device)
    if params.allowed_token_ids is not None:
        allowed = to_device(params.allowed_token_ids, torch.long, device)
        logits = torch.full_like(logits, float("-inf")).index_copy_(1, allowed, logits[:, allowed])
    if rules.bad_words or rules.choices:
        # the output's tail is enough: a word is matched at the text's end, and an output longer than every
        # choice (a tail one longer than the longest) can be none of them
        keep = max([len(word) for word in rules.bad_words] + [len(choice) + 1 for choice in rules.choices])
        texts = _node_texts(output_ids[-keep:], tree, candidates, num_nodes)
        _ban_bad_words(logits, rules.bad_words, texts)
        if rules.choices:
            logits = _follow_choices(logits, rules, texts)
    if rules.guide is not None:
        tokens = candidates.tolist() if tree is not None and num_nodes > 1 else [None]
        logits = _follow_guide(logits, rules, output_ids, tokens, tree.spec.parent_ids if num_nodes > 1 else (-1,))
    if not params.has_count_penalties:
        return logits  # skip the [N, V] counts
    rows = candidates[None] if tree is not None and num_nodes > 1 else None
    return count_penalties(logits[None], [params], [output_ids], [prompt_ids], tree, rows)[0]


def batch_changes(logits: torch.Tensor, params: Sequence[SamplingParams], rules: Sequence[TokenRules],
                  outputs: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]], tree: DeviceTree,
                  candidates: torch.Tensor, tokens: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """`penalize` for G rows whose logit changes are at most a guide and count penalties (no bias, allowed
    tokens, bad words or choices: `EngineRequest.batchable`), at once: logits [G, N, V] at the nodes of `tree`,
    candidates [G, N] (and the same on the host, `tokens`, if at hand) -> float32 logits, each row's guide
    followed, then its penalties applied."""
    logits = logits.float()
    guided = [g for g, rule in enumerate(rules) if rule.guide is not None]
    if guided:
        at = to_device(guided, torch.long, logits.device)
        logits[at] = follow_guides(logits[at], [rules[g] for g in guided], [outputs[g] for g in guided], tree,
                                   candidates[at], [tokens[g] for g in guided] if tokens is not None else None)
    penalized = [g for g, p in enumerate(params) if p.has_count_penalties]
    if penalized:
        at = to_device(penalized, torch.long, logits.device)
        logits[at] = count_penalties(logits[at], [params[g] for g in penalized], [outputs[g] for g in penalized],
                                     [prompts[g] for g in penalized], tree, candidates[at])
    return logits


def count_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]],
                    prompts: Sequence[Sequence[int]], tree: DeviceTree | None,
                    candidates: torch.Tensor | None) -> torch.Tensor:
    """The repetition penalty and OpenAI's presence / frequency penalties of G rows at once: logits [G, N, V] at
    the nodes of `tree` (candidates [G, N]; or None, and N = 1, with no tree) -> float32 logits. Each node
    counts the row's output (which ends with the root) and its own path below the root; the repetition
    penalty also every prompt token. Nothing is read back (counts by index_add, not bincount)."""
    rows, nodes, vocab = logits.shape
    device = logits.device
    ids = to_device([token + g * vocab for g, output in enumerate(outputs) for token in output], torch.long, device)
    counts = torch.zeros(rows * vocab, device=device).index_add_(0, ids, torch.ones(len(ids), device=device))

    def per_row(name: str) -> torch.Tensor:  # [G]
        return to_device([getattr(p, name) for p in params], torch.float32, device)

    repetition = prompt_seen = None
    if any(p.repetition_penalty != 1 for p in params):
        repetition = per_row("repetition_penalty")
        in_prompt = [token + g * vocab for g, (p, prompt) in enumerate(zip(params, prompts))
                     if p.repetition_penalty != 1 for token in prompt]
        if in_prompt:
            prompt_seen = torch.zeros(rows * vocab, dtype=torch.bool, device=device)
            prompt_seen[to_device(in_prompt, torch.long, device)] = True
            prompt_seen = prompt_seen.view(rows, 1, vocab)
    return apply_count_penalties(logits, counts.view(rows, 1, vocab), per_row("frequency_penalty"),
                                 per_row("presence_penalty"), repetition, prompt_seen, tree, candidates)


def apply_count_penalties(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                          repetition: torch.Tensor | None, prompt_seen: torch.Tensor | None, tree: DeviceTree | None,
                          candidates: torch.Tensor | None) -> torch.Tensor:
    """The host's rows' penalties (`count_penalties`): logits [G, N, V]; counts [G, 1, V] of each row's output
    (ending with the root); frequency, presence [G]; repetition [G] or None (all 1); prompt_seen [G, 1, V] bool
    or None (no prompt token counts) -> float32 logits, each node's counts with its own path below the root
    added (candidates [G, N]). A row of zero penalties (and repetition 1) keeps its logits exactly.

    Every node is penalized by its row's counts ([G, 1, V], broadcast: three passes over [G, N, V]); then
    the cells of the tree's own tokens, [G, N, N] of them, are computed again with the node's own counts
    there (`penalize_path_cells`). Materializing per-node counts [G, N, V] instead cost a dozen passes."""
    seen = None
    if repetition is not None:
        seen = counts > 0 if prompt_seen is None else (counts > 0) | prompt_seen  # [G, 1, V]
    out = count_penalized(logits.float(), counts, seen, frequency, presence, repetition)
    if candidates is None or logits.shape[1] == 1:
        return out
    columns = path_columns(candidates)
    cell_counts = counts.expand_as(logits).gather(2, columns)
    cell_seen = None if seen is None else seen.expand_as(logits).gather(2, columns)
    return penalize_path_cells(out, logits.float().gather(2, columns), cell_counts, cell_seen, frequency,
                               presence, repetition, tree, candidates)


def path_columns(candidates: torch.Tensor) -> torch.Tensor:
    """candidates [G, N] -> [G, N, N] long: cell (g, n, j) is the column of token candidates[g, j] at node n."""
    rows, nodes = candidates.shape
    return candidates[:, None, :].expand(rows, nodes, nodes)


def penalize_path_cells(out: torch.Tensor, cell_logits: torch.Tensor, cell_counts: torch.Tensor,
                        cell_seen: torch.Tensor | None, frequency: torch.Tensor, presence: torch.Tensor,
                        repetition: torch.Tensor | None, tree: DeviceTree, candidates: torch.Tensor) -> torch.Tensor:
    """out [G, N, V] penalized by each row's counts alone -> out (in place) with the `path_columns` cells
    penalized again from their unpenalized values (cell_logits float32 [G, N, N]) with node n's own path
    below the root counted: cell_counts [G, N, N] the row's counts there, cell_seen bool or None (no
    repetition penalty). A token on a node's path counts once more per occurrence; all cells of one node
    sharing a token write the same value, so the scatter is deterministic."""
    same = candidates[:, :, None] == candidates[:, None, 1:]  # [G, N(j), N - 1(k)]
    # over k >= 1, node n's ancestors-or-self below the root (the root is in the output already)
    extra = torch.einsum("nk,gjk->gnj", tree.mask[:, 1:].float(), same.float())  # [G, N(n), N(j)]
    seen = None if cell_seen is None else cell_seen | (extra > 0)
    cells = count_penalized(cell_logits, cell_counts + extra, seen, frequency, presence, repetition)
    return out.scatter_(2, path_columns(candidates), cells)


def _node_texts(output_ids: Sequence[int], tree: DeviceTree | None, candidates: torch.Tensor | None,
                num_nodes: int) -> list[list[int]]:
    """Each node's text: the output (ending with the root; or its tail), then the node's path below the root,
    node included. A host loop over nodes: only requests with token-sequence rules (rare, small) come here."""
    output = list(output_ids)
    if tree is None or num_nodes == 1:
        return [output]
    tokens = candidates.tolist()
    return [output + [tokens[j] for j in path] for path in tree.spec.node_paths[:num_nodes]]


def _ban_bad_words(logits: torch.Tensor, words: Sequence[tuple[int, ...]], texts: list[list[int]]) -> None:
    """In place: at each node, the last token of every word whose other tokens end the node's text is banned."""
    for i, text in enumerate(texts):
        for word in words:
            before = len(word) - 1
            if before == 0 or (len(text) >= before and text[len(text) - before:] == list(word[:-1])):
                logits[i, word[-1]] = float("-inf")


def _follow_choices(logits: torch.Tensor, rules: TokenRules, texts: list[list[int]]) -> torch.Tensor:
    """Each node may write only a next token of a choice its text is a prefix of, or an end token where its text
    is a whole choice (or has left every choice: a text the rules kept from the start never does)."""
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    for i, text in enumerate(texts):
        n = len(text)
        nexts = {choice[n] for choice in rules.choices if len(choice) > n and list(choice[:n]) == text}
        if not nexts or any(list(choice) == text for choice in rules.choices):
            nexts.update(rules.ends)
        allowed[i, sorted(nexts)] = True
    return logits.masked_fill(~allowed, float("-inf"))


def follow_guides(logits: torch.Tensor, rules: Sequence[TokenRules], outputs: Sequence[Sequence[int]],
                  tree: DeviceTree, candidates: torch.Tensor,
                  tokens: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """`penalize` for G rows whose guides are their only logit changes, at once: logits [G, N, V] at the nodes
    of `tree` and candidates [G, N] (read back here unless `tokens` has them already) -> float32 logits with
    each row's guide followed at each of its nodes. One mask and one fill for them all, where row by row each
    costs its own."""
    rows, nodes, vocab = logits.shape
    guides, states, ends = [], [], []
    for rule, output, row in zip(rules, outputs, candidates.tolist() if tokens is None else tokens):
        states += _guide_states(rule, output, row, tree.spec.parent_ids)
        guides += [rule.guide.guide] * nodes
        ends += [rule.ends] * nodes
    flat = logits.reshape(rows * nodes, vocab).float()
    return _mask_by_guides(flat, guides, states, ends).view(rows, nodes, vocab)


def _follow_guide(logits: torch.Tensor, rules: TokenRules, output_ids: Sequence[int], tokens: Sequence[int],
                  parents: Sequence[int]) -> torch.Tensor:
    """Each node may write only tokens that keep its text (the output, then its path below the root) a prefix of
    a match of the guide's pattern, and an end token where that text matches."""
    states = _guide_states(rules, output_ids, tokens, parents)
    return _mask_by_guides(logits, [rules.guide.guide] * len(states), states, [rules.ends] * len(states))


def _guide_states(rules: TokenRules, output_ids: Sequence[int], tokens: Sequence[int],
                  parents: Sequence[int]) -> list[int]:
    """The guide's state at each node (tokens [N], the root's first; parents [N], parents before children): the
    root's after the output, which ends with it; a node's after its parent's, then its own token. One move a
    node, where walking each node's path from the root would take one a token of it."""
    guide, states = rules.guide.guide, [rules.guide.state_after(output_ids)]
    for node in range(1, len(tokens)):
        states.append(guide.advance(states[parents[node]], tokens[node]))
    return states


def _mask_by_guides(logits: torch.Tensor, guides: Sequence[RegexGuide], states: Sequence[int],
                    ends: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """logits [M, V]: row m may write only what guides[m] allows in states[m]. A row left with nothing to write
    (other rules banned every token the guide allows) may end, with one of ends[m]. Nothing is read back."""
    allowed = _guide_masks(guides, states, logits.device)  # [M, V']
    vocab = logits.shape[-1]  # the model's rows past the tokenizer's (padding) are never allowed
    allowed = allowed[:, :vocab] if allowed.shape[1] >= vocab else F.pad(allowed, (0, vocab - allowed.shape[1]))
    logits = logits.masked_fill(~allowed, float("-inf"))
    stuck = torch.isneginf(logits).all(-1, keepdim=True)  # [M, 1]
    columns = sorted(set().union(*ends))
    flags = {row: [column in row for column in columns] for row in set(ends)}
    ends_of_row = to_device([flags[row] for row in ends], torch.bool, logits.device)  # [M, C]
    at = to_device(columns, torch.long, logits.device)
    logits[:, at] = logits[:, at].masked_fill(stuck & ends_of_row, 0.0)  # [M, C]
    return logits


def _guide_masks(guides: Sequence[RegexGuide], states: Sequence[int], device: torch.device) -> torch.Tensor:
    """bool [M, V'] row m what guides[m] allows in states[m]: one gather a guide (`RegexGuide.masks`)."""
    distinct = list(dict.fromkeys(guides))
    if len(distinct) == 1:
        return distinct[0].masks(states, device)
    out = torch.empty(len(states), distinct[0].trie.vocab, dtype=torch.bool, device=device)
    for guide in distinct:
        rows = [m for m, g in enumerate(guides) if g is guide]
        out[to_device(rows, torch.long, device)] = guide.masks([states[m] for m in rows], device)
    return out


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """logits [n, V], row i the distribution tokens[i] came from -> each token's log-probability, its rank and
    the k most likely alternatives (one copy to the host)."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp[torch.arange(len(tokens), device=logp.device), torch.tensor(list(tokens), device=logp.device)]
    ranks = (logp > chosen[:, None]).sum(-1) + 1  # [n]
    alternatives = [[] for _ in tokens]
    if k:
        top = logp.topk(k, dim=-1)
        alternatives = [list(zip(ids, values)) for ids, values in zip(top.indices.tolist(), top.values.tolist())]
    return [TokenLogprob(token, lp, alt, rank)
            for token, lp, alt, rank in zip(tokens, chosen.tolist(), alternatives, ranks.tolist())]
