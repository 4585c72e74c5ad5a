"""The largest values a search accepts, so an absurd flag or sweep field is a one-line error, not an
OverflowError from an int64 column, a MemoryError from a 10^20-long list, or "Infinity" in `--json`.

Each bound is far above any real training job; the point is a bounded answer, not a judgement on the recipe.
"""

from __future__ import annotations

from planner import env
from planner.spec import MAX_BATCH, MAX_INSTANCES
from planner.spec import MAX_DATASET_SIZE as SPEC_MAX_DATASET_SIZE
from planner.spec import MAX_GRAD_ACCUM as SPEC_MAX_GRAD_ACCUM

# Sampler seeds: numpy's RandomState (which Optuna's samplers use) takes seeds in [0, 2^32 - 1]
# (numpy.random.RandomState docs); each further worker adds its number (planner.search.study), so half
# the range leaves room for 2^31 workers. Not overridable: numpy's limit.
MAX_SEED = 2**31 - 1

# Micro-batches and sequence lengths in a search space: the same int32 indexing bound as one micro-batch
# (planner.spec.MAX_BATCH); the model's own limits (positions) reject far smaller values later.
MAX_SPACE_VALUE = MAX_BATCH

# Micro-steps per optimizer step: the estimate's own limit (planner.spec.MAX_GRAD_ACCUM, $PLANNER_MAX_GRAD_ACCUM).
MAX_GRAD_ACCUM = SPEC_MAX_GRAD_ACCUM

# Samples per optimizer step and per epoch: integers that a float64 holds exactly (2^53, IEEE 754), since
# the trials table and `--json` carry them as numbers.
MAX_GLOBAL_BATCH = 2**53
MAX_DATASET_SIZE = SPEC_MAX_DATASET_SIZE  # planner.spec.MAX_DATASET_SIZE: the same for estimate

# Passes over the dataset. ASSUMPTION: 10^6, far above any training recipe; keeps hours and $ per job finite
# (2^53 samples × 10^6 epochs is ~10^22 samples, a finite float). Override: $PLANNER_MAX_EPOCHS.
MAX_EPOCHS = float(env.limit("PLANNER_MAX_EPOCHS"))

# Finished trials wanted in one study. ASSUMPTION: 10^7, far above any search (the default is 100; a whole
# grid of every dimension is ~10^5); at ~2,000 trials/s it is still hours, not forever (a TPE search never
# ends on its own below its budget).
MAX_TRIALS = 10**7

# Instances per job: the estimate's own limit (planner.spec.MAX_INSTANCES, $PLANNER_MAX_INSTANCES).
MAX_SEARCH_INSTANCES = MAX_INSTANCES

# The trial budget of a TPE search (planner.search.study.default_trials, which says why these numbers):
# DEFAULT_TRIALS on one instance type, TRIALS_PER_EXTRA_TYPE more for each further type.
DEFAULT_TRIALS = 100
TRIALS_PER_EXTRA_TYPE = 2
