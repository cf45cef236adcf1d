"""`python -m keras_torch_distribution ARGS` is `ktd ARGS` (after the
package's own import; `python -m keras_torch_distribution_cli` is the same
without it)."""

import sys

from keras_torch_distribution_cli import main

sys.exit(main())
