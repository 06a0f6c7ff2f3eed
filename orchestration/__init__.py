"""Shoal's imperative shell: trainers, fleets, learners and the CLI, in one process or on Ray.

Importing it imports ``core`` first (no torch): :mod:`core.dynamo_deferral` is in place before any tensordict.
"""

import core  # noqa: F401
