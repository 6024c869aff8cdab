"""``python -m pipeline fit|validate|test ...``: see :mod:`pipeline.cli`."""

from pipeline.cli import main

if __name__ == "__main__":
    main()
