"""``python -m conveyor``: the same command line as the ``conveyor`` script."""

from conveyor.cli.main import main

if __name__ == "__main__":
    main()
