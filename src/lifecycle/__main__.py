from lifecycle.cli import main

raise SystemExit(main())
