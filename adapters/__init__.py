"""Other people's environments as Shoal batched envs (:class:`adapters.protocol.BatchedEnv`).

Submodules import their frameworks lazily: ``adapters.gymnasium_env`` needs gymnasium,
``adapters.pettingzoo_env`` PettingZoo, ``adapters.torchrl_env`` torchrl, ``adapters.builtin`` only torch.
"""

from adapters.checking import CheckMode, EnvOutputError, IllegalActionError, validate_step
from adapters.protocol import BatchedEnv

__all__ = ["BatchedEnv", "CheckMode", "EnvOutputError", "IllegalActionError", "validate_step"]
