"""What each process `ktd run` starts runs first: `python -m
keras_torch_distribution_cli._rank SCRIPT [ARGS]`.

It is the package's `launch.__main__` (the script run as __main__, the
backend installed into Keras when the script imports Keras, a failure
recorded for the launcher, death with the launcher), loaded without the
package's `__init__` (`_light`): a rank imports Keras when its script
does, not before, so a script that never imports Keras starts as fast as
under torchrun.
"""

import sys

from keras_torch_distribution_cli._light import package_without_keras


def main(argv):
    with package_without_keras():
        from keras_torch_distribution.launch import __main__ as rank
    rank.die_with_parent()
    rank.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
