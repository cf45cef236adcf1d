"""One rank-aware logger for the package: rank 0 speaks, others stay quiet.

Set KTD_LOG_ALL_RANKS=1 to hear every rank; KTD_LOG_LEVEL (default WARNING)
sets the level.
"""

import logging
import os

import torch.distributed as dist

from keras_torch_distribution import _env


def _rank():
    """This process's rank: the running group's, else the launcher's RANK
    (so that messages from before the group starts are not said N times)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    text = os.environ.get("RANK", "0")
    return int(text) if text.isdigit() else 0


class _RankFilter(logging.Filter):
    def filter(self, record):
        record.rank = _rank()
        return record.rank == 0 or _env.log_all_ranks()


logger = logging.getLogger("keras_torch_distribution")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(
        logging.Formatter("[ktd rank %(rank)s] %(levelname)s: %(message)s")
    )
    _handler.addFilter(_RankFilter())
    logger.addHandler(_handler)
    logger.setLevel(_env.log_level())
    logger.propagate = False


def warn_once(key, message, *args):
    """Warn once per `key` for the life of the process."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message, *args)


_warned = set()
