"""Recipe cards: the YAML format of the reference cards (reference/003_*.txt), as a model.

A card has the sections schema_version, model, gpu, author, status, stack, workload, layout,
result, correctness, env, patches, run and notes. `gpu`, `author` and `result` are typed
(dataclasses); the free-form sections stay mappings, checked by the schema where they have
known fields. `RecipeCard.from_yaml(text)` validates and raises CardError with every problem,
one per line, each naming the field path; `to_yaml()` writes the same format back (the
reference cards round-trip: same data, same section order, the leading comment kept).

The parts: the schema and `validate` (recipes/card_schema.py), the model (recipes/card_model.py)
and `card`, the card of a measured run (recipes/card_from_run.py); all importable from here.
"""

from __future__ import annotations

# every public name of the three parts, importable from here
from traindx.recipes.card_from_run import *  # noqa: F403
from traindx.recipes.card_model import *  # noqa: F403
from traindx.recipes.card_schema import *  # noqa: F403
