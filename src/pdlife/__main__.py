"""``python -m pdlife``: the ``pdlife`` command line."""

from pdlife.cli import main

raise SystemExit(main())
