"""Batch-1 decoding: speculate only while it beats plain decoding on this device's clock.

The batch-1 decoder's tree is chosen once, from timed forwards and the heads'
held-out accuracies (`tree_select.choose_tree`). Real text is often harder than
held-out data, and on a CPU a tree of 8-16 tokens costs 1.3-2 single-token
steps plus the heads' vocabulary projection (2 cores, RESULTS.md session 47;
1.5-2.5 in session 27): a chat prompt ran at 0.74x plain decoding's speed
without this gate (README, session 6). So the decoder measures both kinds of
step as it goes and runs the faster one, the way the engine's `TreePolicy`
does for each batch size:

- the first TRIAL_STEPS steps speculate, the next TRIAL_STEPS run plain;
- from then on a step speculates when the recent speculative steps' tokens per
  second beat plain decoding's by MARGIN (the heads' time counted in: a step
  that speculates next must run them first). The tokens per speculative step
  start from the tree's expected accepted length under the heads' accuracies,
  worth PRIOR_STEPS steps, so that a few unlucky trial steps (an answer's first
  words are the hardest to guess) do not switch speculation off;
- a run of REVISIT_STEPS plain steps is followed by one speculative step, so
  that text the heads do well on (a list, code, a quotation) wins speculation back.

Greedy decoding only: whichever step runs, its tokens are plain greedy decoding's,
while a seeded sampling run must consume its random numbers the same way every time.
"""

from __future__ import annotations

from collections import deque
from statistics import median

from medusa.decoding.tree_policy import MARGIN

TRIAL_STEPS = 4  # steps of each kind before the measurements decide
WINDOW = 16  # the recent steps of each kind whose time and tokens count
PRIOR_STEPS = 8  # how many speculative steps the heads' predicted accepted length is worth
REVISIT_STEPS = 16  # plain steps in a row before speculation gets one step to re-measure


class SpeculationGate:
    def __init__(self, expected_length: float = 1.0) -> None:
        """expected_length: the tree's predicted tokens per speculative step (1.0: no prediction)."""
        self.expected_length = expected_length
        self._spec_seconds: deque[float] = deque(maxlen=WINDOW)  # step + heads, per speculative step
        self._spec_tokens: deque[int] = deque(maxlen=WINDOW)  # tokens each emitted
        self._plain_seconds: deque[float] = deque(maxlen=WINDOW)
        self._plain_run = 0  # plain steps since the last speculative one

    def speculate(self) -> bool:
        """Whether the next step should verify the tree (else the single root token)."""
        if len(self._spec_seconds) < TRIAL_STEPS:
            return True
        if len(self._plain_seconds) < TRIAL_STEPS:
            return False
        if self._plain_run >= REVISIT_STEPS:
            return True
        return self.tokens_per_step() / median(self._spec_seconds) > MARGIN / median(self._plain_seconds)

    def tokens_per_step(self) -> float:
        """Tokens per speculative step: the recent ones', with the prediction worth PRIOR_STEPS of them."""
        tokens = self.expected_length * PRIOR_STEPS + sum(self._spec_tokens)
        return tokens / (PRIOR_STEPS + len(self._spec_tokens))

    def observe(self, speculative: bool, seconds: float, emitted: int) -> None:
        """A finished step: its wall time (a speculative one's including the heads that proposed
        its tree) and the tokens it emitted."""
        if speculative:
            self._spec_seconds.append(seconds)
            self._spec_tokens.append(emitted)
            self._plain_run = 0
        else:
            self._plain_seconds.append(seconds)
            self._plain_run += 1
