"""kvshard: KV caches under distributed LLM inference parallelism.

The C++ library through pybind11 (kvshard._kvshard), thin like the CLI: models and parallel
configurations are values (==, repr, to_dict), layouts, plans and transfer plans are pure
functions of them, and the dicts they return are the CLI's ``--json`` documents. Wrong input
raises :class:`kvshard.Error` (a ValueError) carrying the library's message.

See docs/python.md.
"""

from . import _kvshard
from ._kvshard import *  # noqa: F401,F403  (the module's public names, listed in __all__)
from ._kvshard import Error, OutOfBlocksError  # noqa: F401

__version__ = "0.1.0"
__all__ = sorted(n for n in dir(_kvshard) if not n.startswith("_"))
