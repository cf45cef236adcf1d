import sys

from keras_torch_distribution.cli import main

sys.exit(main())
