import sys

from keras_torch_distribution_cli import main

sys.exit(main())
