"""Rollouts, fragments, train batches and episode statistics (pure functions plus two small stateful pieces).

Stateful: :class:`FragmentBuilder` (steps -> fragments, on the actor) with its :class:`EpisodeTracker`, and
the seed-001 facade :class:`MultiAgentRolloutBuffer`. Everything else takes and returns TensorDicts.
"""

from core.buffers.batching import (concat_fragments, drop_trivial_masks, flatten_transitions, gathered_minibatches,
                                   minibatches)
from core.buffers.episodes import (
    advance_carry,
    agent_trajectory,
    completed_episodes,
    empty_carry,
    episode_stats,
    scan_episodes,
    summarize_episodes,
)
from core.buffers.fragments import FragmentBuilder, bootstrap_step
from core.buffers.rollout_buffer import MultiAgentRolloutBuffer
from core.buffers.sequences import sequence_starts, split_sequences
from core.buffers.staleness import is_fresh, is_ready, retired, select_batch, stale
from core.buffers.tracking import EpisodeTracker

__all__ = [
    "EpisodeTracker",
    "FragmentBuilder",
    "MultiAgentRolloutBuffer",
    "advance_carry",
    "agent_trajectory",
    "bootstrap_step",
    "completed_episodes",
    "concat_fragments",
    "empty_carry",
    "episode_stats",
    "drop_trivial_masks",
    "flatten_transitions",
    "gathered_minibatches",
    "is_fresh",
    "is_ready",
    "minibatches",
    "retired",
    "scan_episodes",
    "select_batch",
    "sequence_starts",
    "split_sequences",
    "stale",
    "summarize_episodes",
]
