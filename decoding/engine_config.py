"""EngineConfig: what an LLMEngine is built with (KV pool, trees, graphs, overlap), checked when made."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from medusa.decoding.scheduler import SchedulerConfig
from medusa.tree import MAX_NODES, TreeSpec


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int = 512
    # KV slots per block. On a GPU a power of two >= 16; from 64 on, Hopper-class GPUs load K/V in whole
    # 64-key chunks by TMA (attention 6-22% faster a call where it matters, RESULTS.md session 28), but
    # prefix caching then shares only whole 64-token blocks (a short system prompt fills none)
    block_size: int = 16
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # names, JSON files' paths or TreeSpecs; user-given trees that need more heads than the engine's are refused,
    # the default ones are dropped
    trees: tuple[str | Path | TreeSpec, ...] = ("single", "tree-4", "tree-8", "tree-16", "tree-32", "tree-64")
    cuda_graphs: bool = True  # capture the decode step per batch bucket and tree (CUDA only)
    max_graph_tokens: int = 1024  # warmup times trees only while bucket x tree size stays under this
    max_model_len: int | None = None  # prompt + output tokens per request; None: min(model context, KV pool)
    # L > 0: every speculative tree gets a chain of L prompt-lookup nodes (n-gram copies of earlier text);
    # a tree's head nodes past 64 - L are dropped. 0: off
    prompt_lookup: int = 0
    # Launch a decode step before the previous one's tokens are back (its roots, committed lengths and
    # proposals stay on the device for the next step), so the host's work on one step runs while the
    # device runs the next; plain and speculative trees alike. None: on where CUDA graphs run (on the CPU
    # nothing runs ahead of the host: tests turn it on to check the logic)
    overlap: bool | None = None
    # A step that decodes and prefills at once runs prompt chunks of up to this many tokens (in all) inside
    # the decode step's forward: the weights are read once for both, where a prompt forward of its own
    # would read them all again (on an 8B model, ~16 GB a step). Bigger chunks get their own forward,
    # where the compute dominates anyway. 0: always their own. Each (batch, tree, token bucket) is a graph
    mixed_prompt_tokens: int = 512
    # With overlap, apply the rows' tokens (stops, text, block commits, outputs) once every this many steps, each
    # sequence's tokens of those steps at once: the host's work per row and step, which bounds a small model at
    # many requests (the default model at 64 requests on an H200: 2.05 ms a plain step against a 1.25 ms graph),
    # shrinks by nearly this factor. Outputs then come this many steps apart, and a sequence that stopped runs up
    # to this many - 1 steps more (their tokens dropped). Steps with rows the host verifies (logprobs, penalties,
    # min_tokens) apply at once. 1: every step
    apply_interval: int = 1

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {self.num_blocks}, {self.block_size}")
        if isinstance(self.trees, (str, Path, TreeSpec)):
            raise ValueError(f"trees must be a tuple of trees, got one: {self.trees!r} (write trees=({self.trees!r},))")
        if not self.trees:
            raise ValueError("trees is empty: give at least one tree name or TreeSpec ('single' is plain decoding)")
        for tree in self.trees:
            if not isinstance(tree, (str, Path, TreeSpec)):
                raise ValueError(f"trees holds {tree!r}: each tree is a name (say 'tree-16'), a JSON file's path "
                                 "or a TreeSpec")
        if not isinstance(self.max_graph_tokens, int) or self.max_graph_tokens < 1:
            raise ValueError(f"max_graph_tokens must be an integer >= 1, got {self.max_graph_tokens!r}")
        if not isinstance(self.mixed_prompt_tokens, int) or self.mixed_prompt_tokens < 0:
            raise ValueError(f"mixed_prompt_tokens must be an integer >= 0, got {self.mixed_prompt_tokens!r}")
        if not isinstance(self.apply_interval, int) or isinstance(self.apply_interval, bool) or self.apply_interval < 1:
            raise ValueError(f"apply_interval must be an integer >= 1, got {self.apply_interval!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        lookup = self.prompt_lookup
        if not isinstance(lookup, int) or isinstance(lookup, bool) or not 0 <= lookup <= MAX_NODES - 2:
            raise ValueError(f"prompt_lookup must be an integer in [0, {MAX_NODES - 2}], got {lookup!r}: a tree "
                             f"holds at most {MAX_NODES} nodes, the root and at least one head node among them")
