"""``python -m pipeline fit|validate|test ...``: see :mod:`pipeline.cli`."""

import sys

from pipeline._help_cache import is_help_request, print_help


def _main() -> None:
    from pipeline.cli import main  # Lightning, torch, MLflow: seconds of imports

    main()


if __name__ == "__main__":
    if is_help_request(sys.argv[1:]):
        print_help(sys.argv[1:], _main)
    _main()
