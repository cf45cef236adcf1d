"""One rank-aware logger for the package: rank 0 speaks, others stay quiet.

Set KTD_LOG_ALL_RANKS=1 to hear every rank; KTD_LOG_LEVEL (default WARNING)
sets the level.
"""

import logging
import os


class _RankFilter(logging.Filter):
    def filter(self, record):
        from keras_torch_distribution import runtime

        rank = runtime.process_id()
        record.rank = rank
        return rank == 0 or os.environ.get("KTD_LOG_ALL_RANKS") == "1"


logger = logging.getLogger("keras_torch_distribution")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(
        logging.Formatter("[ktd rank %(rank)s] %(levelname)s: %(message)s")
    )
    _handler.addFilter(_RankFilter())
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("KTD_LOG_LEVEL", "WARNING").upper())
    logger.propagate = False


def warn_once(key, message, *args):
    """Warn once per `key` for the life of the process."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message, *args)


_warned = set()
