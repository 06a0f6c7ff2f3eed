"""Environment collections (seed 002): envs indexed by string ids and the pure logic that picks among them.

Several envs need a structure: a :class:`Split` (train on some, evaluate on others), a :class:`Curriculum` (a
partial order unlocked as a metric passes a threshold), an :class:`AdversarialSet` (train most where the
learner does worst) or a :class:`PriorDistribution` (env parameters drawn per episode). :class:`EnvCollection`
ties members and structure together and has a JSON form for config files. Everything here is a value or a
pure function; randomness comes in as a ``torch.Generator``. Running the envs is orchestration's job.
"""

from .adversarial import AdversarialSet
from .collection import STRUCTURES, EnvCollection, EnvMember, Structure, StructureProtocol
from .curriculum import Curriculum, CurriculumState, find_cycle
from .ids import CollectionError
from .priors import Choice, Distribution, Normal, PriorDistribution, Uniform
from .serialize import FORMAT, collection_from_dict, collection_to_dict, from_json, to_json
from .split import Split

__all__ = [
    "FORMAT", "STRUCTURES", "AdversarialSet", "Choice", "CollectionError", "Curriculum", "CurriculumState",
    "Distribution", "EnvCollection", "EnvMember", "Normal", "PriorDistribution", "Split", "Structure",
    "StructureProtocol", "Uniform", "collection_from_dict", "collection_to_dict", "find_cycle", "from_json",
    "to_json",
]
