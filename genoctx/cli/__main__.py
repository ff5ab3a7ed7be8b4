"""``python -m genoctx.cli``: the ``genoctx`` command line."""

from . import main

main()
