"""Hand-modelled transformer families: one trait record per family (`traits.Family`) in one registry.

Interpreters ask `family(spec.family).gated_mlp`, never `spec.family in ("llama", "mistral")`. See
ARCHITECTURE.md, "Adding a model family".
"""

from planner.families.registry import FAMILIES, family
from planner.families.traits import Family, Linear

__all__ = ["FAMILIES", "Family", "Linear", "family"]
